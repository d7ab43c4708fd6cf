"""Tensor-parallel checks shared by the tests and ``tilefuse bench tp``: a pool of ranks, and the
tolerance within which a sharded module's output equals the one-device module's.

:class:`Ranks` spawns ``world_size`` processes in one ``torch.distributed`` group (gloo on CPU
tensors, NCCL with one GPU per rank) once, then runs any number of jobs on all of them, so a test
module pays the process start once.

Tolerance (:func:`tp_tolerance`, :func:`check_within`): elementwise
``|y_tp - y_1| <= factor * S`` with ``S = |x| @ |W|^T`` in fp64, the sum of the magnitudes of the
products that make each output (it does not vanish where the sum cancels). The two outputs differ
only in reduction order and roundings. One GEMM output in the activation dtype is within ``2u S``
of the exact value: its final rounding, plus one rounding of partial sums where the GEMM splits K
and combines in the activation dtype (cuBLAS may, PyTorch allows it for bf16/fp16); fp32
summation order adds ~2^-16 S at most at these sizes. Hence:

* column-parallel (and MLA heads): the same dot products on a smaller matrix, each side within
  ``2u S``: ``factor = 4u + 2^-16``;
* row-parallel: the one-device GEMM (``2u S``), each rank's partial GEMM (``2u S_r``, with
  ``sum S_r = S``) and the all-reduce's rounding of the sum (``u |y|``): ``5u``, written
  ``factor = 6u + 2^-16``;
* SwiGLU MLP: the row-parallel down projection plus a 1-ulp flip of each fused intermediate ``h``
  (``2u |h|``, carried into S of the down projection): ``factor = 8u + 2^-16``;
* unfused SwiGLU (``silu(gate(x)) * up(x)`` in the activation dtype, the 2-bit VQ MLP): gate, up,
  silu and the product are each rounded and each may flip by one ulp (``8u |h|``), plus the
  row-parallel down projection's ``6u``: ``factor = 16u + 2^-16``.

``u`` is the unit roundoff of the activation dtype: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32. Observed
on the CPU reference path: 0.1-0.2 of these bounds in bf16/fp16; on the H200 at the benchmark's
shapes 0.01-0.02.

These worst-case bounds grow with S, which outgrows ``|y|`` by about ``sqrt(K)``: at K = 28672 a
wholly wrong output is only ~2u S away. So :func:`check_within` also bounds the relative Frobenius
error ``||y_tp - y_1|| / ||y_1|| <= 4u + 2^-16`` (:func:`rel_tolerance`): roundings are not all
worst case at once, and the measured values are ~0.7u (cos_diff 4-6.5e-6 in bf16), while a shard
cut or summed wrongly is off by O(1).
"""

from __future__ import annotations

import os
import socket
import traceback

import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
FACTOR_ULPS = {"column": 4, "row": 6, "mlp": 8, "unfused-mlp": 16}
ACCUMULATION = 2.0 ** -16


def tp_tolerance(dtype: torch.dtype, kind: str) -> float:
    """``factor`` of ``|y_tp - y_1| <= factor * S`` for a layer ``kind`` ("column", "row", "mlp")."""
    return FACTOR_ULPS[kind] * UNIT_ROUNDOFF[dtype] + ACCUMULATION


def rel_tolerance(dtype: torch.dtype) -> float:
    """Bound of the relative Frobenius error between a sharded and a one-device output."""
    return 4 * UNIT_ROUNDOFF[dtype] + ACCUMULATION


def error_scale(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``|x| @ |W|^T`` in fp64: x ``[..., K]``, weight ``[N, K]`` -> ``[..., N]``."""
    return x.detach().double().abs() @ weight.detach().double().abs().T


def check_within(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, factor: float, name: str = "out") -> float:
    """Raise AssertionError unless ``|out - ref| <= factor * scale`` elementwise (NaN fails) and the
    relative Frobenius error is within :func:`rel_tolerance`; returns the worse of the two ratios
    error / bound (<= 1 passes)."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    diff = (out.detach().double() - ref.detach().double()).abs()
    bound = factor * scale.double().to(diff.device) + 1e-30
    ratio = diff / bound
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if not worst <= 1.0:
        idx = ratio.flatten().nan_to_num(float("inf")).argmax()
        raise AssertionError(f"{name}: |tp - one device| up to {worst:.3g} x the tolerance ({factor:.3g} x |x||W|); "
                             f"worst element {float(out.flatten()[idx]):.6g} vs {float(ref.flatten()[idx]):.6g}")
    from tilefuse.testing.compare import rel_err

    rel = rel_err(out, ref) / rel_tolerance(out.dtype if out.dtype in UNIT_ROUNDOFF else torch.float32)
    if not rel <= 1.0:
        raise AssertionError(f"{name}: relative error {rel:.3g} x the tolerance "
                             f"({rel_tolerance(out.dtype):.3g}); a shard cut or summed wrongly?")
    return max(worst, rel)


# ----------------------------------------------------------------------------- a pool of ranks
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(rank: int, world_size: int, backend: str, port: int, jobs, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                results.put((rank, True, fn(*args)))
            except BaseException:  # noqa: BLE001 -- sent back to the parent, which raises
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Ranks:
    """``world_size`` spawned processes in one process group; :meth:`run` runs a job on all.

    backend : "gloo" (CPU tensors) or "nccl" (rank r on ``cuda:r``). Jobs are module-level
    functions (picklable); each rank returns a picklable result.
    """

    def __init__(self, world_size: int = 2, backend: str = "gloo", timeout: float = 300.0):
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self._start()

    def _start(self) -> None:
        self.results = self.ctx.Queue()
        self.jobs = [self.ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self.procs = [self.ctx.Process(target=_serve, args=(r, self.world_size, self.backend, port, self.jobs[r],
                                                            self.results), daemon=True)
                      for r in range(self.world_size)]
        for proc in self.procs:
            proc.start()

    def _restart(self) -> None:
        """A failed job can leave the other ranks inside a collective that never completes: start
        the ranks afresh so that the next job does not meet them out of step."""
        for proc in self.procs:
            proc.kill()
            proc.join(timeout=30)
        self._start()

    def run(self, fn, *args) -> list:
        """``fn(*args)`` on every rank; the ranks' results in rank order. A rank's exception (or no
        answer within ``timeout`` seconds) is raised here as an AssertionError carrying its
        traceback, and the ranks are restarted for the next job."""
        import queue

        for jobs in self.jobs:
            jobs.put((fn, args))
        out, failures = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=self.timeout)
            except queue.Empty:
                failures.append(f"no answer within {self.timeout:.0f} s (a rank waits in a collective, or hangs)")
                break
            if ok:
                out[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break          # the other rank may wait in a collective for this one: do not wait for it
        if failures:
            self._restart()
            raise AssertionError("\n".join(failures))
        return out

    def close(self) -> None:
        for queue in self.jobs:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
