"""Concurrency stress of every op family and kernel variant: ``tilefuse stress`` (``python -m
tilefuse stress``), ``tests/test_stress.py`` and anyone checking a build on their GPU.

For each *group* (a family, MLA split in three: the dense bf16 cache, the FP8 cache and the sparse
decode) and each variant it dispatches among -- the registry's variants (``tilefuse.force(variant=
...)``, the unfused / cuBLAS baselines included), ``"default"`` (the dispatch's own pick) and, for
the sparse decode, the two paths its cost model picks between -- pinned in turn, pairs of calls
(the same shape twice, and two shapes: split-K SwiGLU widths 2 and 4, decode-sized VQ and MLA) run

* ``streams``: on two CUDA streams of one thread, each stream issuing its call ``reps`` times back
  to back, so the two overlap on the GPU;
* ``threads``: on two Python threads, each with its own stream (and its own ``force()`` state:
  pins are thread-local);
* ``graphs``: captured into two CUDA graphs, each with ``torch.cuda.graph`` on its own, then
  replayed at once on two streams;

``iters`` times each, and every output is compared with the same call made alone (on the default
stream, before any of it; for ``graphs``, its own graph replayed alone). ``after`` runs each
call alone once more at the end: state left dirty by the concurrent calls (a split-K counter not
reset) shows there. Scratch that two calls share without ordering (``tilefuse._scratch``'s
contract) shows as wrong outputs.

Comparison (:func:`matches`): bit for bit, except the VQ kernels that add split-K partial sums with
fp32 atomics in arrival order (``decode``, ``decode_tl``, ``mma``, ``prefill`` -- the WGMMA kernel
splits K when its tiles leave SMs idle -- and the default dispatch, which picks them): their outputs may differ in the last fp32 bits, i.e. by at most about
one bf16 ulp of the output, so ``|out - alone| <= 1e-3 + 2^-7 |alone|``. A lost or doubled partial
sum is off by O(0.1-1) at these shapes. Every mismatch also records the largest difference, so a
report tells an ulp flip from a race.

A variant that cannot run here (``kernel_status`` of its family says why, or the op refuses the
shape with a ``ValueError``) is reported as skipped with the reason; any other exception is an
error. :func:`run` returns the rows; :func:`main` is the command.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tilefuse._registry import FAMILIES

DESCRIPTION = ("Run every op family (swiglu, swiglu_fp8, vq, and MLA decode over a bf16 cache, an FP8 cache "
               "and sparse) at each kernel variant it dispatches among, pinned in turn, plus the default dispatch: "
               "pairs of calls (the same shape and two shapes) at once on two CUDA streams, on two Python threads "
               "and as two CUDA graphs replayed together, every output compared with the same call made alone. "
               "Prints wrong/compared outputs per mode; exits 1 if any output was wrong, a call failed, or "
               "nothing could run (no CUDA GPU).")
# group -> the family whose variants, kernel_status and force() pins apply
GROUPS = {"swiglu": "swiglu", "swiglu_fp8": "swiglu_fp8", "vq": "vq", "mla": "mla", "mla_fp8": "mla",
          "mla_sparse": "mla"}
# Paths a group's dispatch picks between that are not force() variants: pinned through the
# family's configs (process-wide, so set once around a row, never per thread).
EXTRA_PINS = {"mla_sparse": ("gather_dense", "gluon_sparse")}
MODES = ("streams", "threads", "graphs", "after")
# VQ variants that add split-K partials with fp32 atomics (arrival order): compared to tolerance
INEXACT = {("vq", "default"), ("vq", "decode"), ("vq", "decode_tl"), ("vq", "mma"), ("vq", "prefill")}
RTOL, ATOL = 2.0 ** -7, 1e-3
DT = torch.bfloat16


@dataclass
class Case:
    """One call: ``call()`` returns a tensor or a tuple of tensors (compared together)."""
    name: str
    call: Callable[[], object]


@dataclass
class Row:
    """What one group / variant / mode gave: ``calls`` outputs compared, ``wrong`` of them off,
    ``max_err`` the largest ``|out - alone|`` among the wrong ones (fp32), ``status`` "ok",
    "wrong", "skipped" or "error", ``reason`` why (skipped / error), ``cases`` the shapes,
    ``seconds`` the mode's wall time (the first mode's includes the calls alone, where the kernels
    compile)."""
    group: str
    variant: str
    mode: str
    calls: int = 0
    wrong: int = 0
    max_err: float = 0.0
    status: str = "ok"
    reason: str = ""
    cases: list[str] = field(default_factory=list)
    seconds: float = 0.0


def variants(group: str) -> tuple[str, ...]:
    """``"default"``, then every variant the group's family registers, then its extra pins."""
    return ("default", *FAMILIES[GROUPS[group]].variants, *EXTRA_PINS.get(group, ()))


def exact(group: str, variant: str) -> bool:
    return (group, variant) not in INEXACT


# ------------------------------------------------------------------------------------- comparing
def _flat(result) -> tuple[torch.Tensor, ...]:
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(t for item in result for t in _flat(item))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its width (NaN payloads, -0.0 and FP8 compared as they lie)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def mismatch(out, alone, exact_: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether ``out`` differs from ``alone`` -- any bit of any tensor of the result, or with
    ``exact_=False`` beyond ``ATOL + RTOL |alone|`` elementwise (NaN only where ``alone`` has one)
    -- and the largest ``|out - alone|`` if it does (fp32; inf for a NaN or inf on one side only),
    as 0-d tensors on the outputs' device, computed on the current stream: no host sync, so a
    check enqueued behind the call on its stream runs in order with it."""
    outs, alones = _flat(out), _flat(alone)
    device = outs[0].device if outs else torch.device("cpu")
    bad = torch.zeros((), dtype=torch.bool, device=device)
    err = torch.zeros((), dtype=torch.float32, device=device)
    if len(outs) != len(alones) or any(o.shape != a.shape or o.dtype != a.dtype for o, a in zip(outs, alones)):
        return bad | True, err + math.inf
    for o, a in zip(outs, alones):
        if not o.numel():
            continue
        differ = _bits(o) != _bits(a)
        if not o.is_floating_point():
            off = differ.any()
            err = torch.where(off, math.inf, err)
        else:
            of, af = o.float(), a.float()
            gap = (of - af).abs()
            if exact_:
                off = differ.any()
            else:
                off = ((gap > ATOL + RTOL * af.abs()) | (of.isnan() != af.isnan())).any()
            size = torch.where(differ, gap.nan_to_num(math.inf), 0.0).max()
            err = torch.where(off, torch.maximum(err, size), err)
        bad = bad | off
    return bad, err


def matches(out, alone, exact_: bool = True) -> bool:
    """``out`` equals ``alone`` (:func:`mismatch`'s rule; reads the answer back: a host sync)."""
    return not bool(mismatch(out, alone, exact_)[0])


def difference(out, alone) -> float:
    """The largest ``|out - alone|`` over every tensor of a result where bits differ (fp32; inf
    where a NaN or inf appears on one side only, or shapes differ); a host sync."""
    return float(mismatch(out, alone, True)[1])


class Tally:
    """Outputs compared and wrong ones for one row. :meth:`check` enqueues the comparison on the
    current stream (call it on the stream that made ``out``, before ``out`` is freed or
    overwritten: stream order keeps the two apart) and keeps its 0-d answer on the device;
    :meth:`flush`, after the streams are synchronized, adds them up. Thread-safe."""

    def __init__(self, expected: list, exact_: bool):
        self.expected, self.exact, self.calls, self.wrong, self.max_err = expected, exact_, 0, 0, 0.0
        self._pending = []
        self._lock = threading.Lock()

    def check(self, index: int, out) -> None:
        answer = mismatch(out, self.expected[index], self.exact)
        with self._lock:
            self._pending.append(answer)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        bad = torch.stack([b for b, _ in pending]).cpu()
        err = torch.stack([e for _, e in pending]).cpu()
        self.calls += len(pending)
        self.wrong += int(bad.sum())
        self.max_err = max(self.max_err, float(err.max()))


def run_threads(work: Callable[[int], None], threads: int = 2) -> None:
    """``work(i)`` on ``threads`` Python threads at once; the first exception is raised here."""
    errors = []

    def guarded(index):
        try:
            work(index)
        except BaseException as exc:  # surfaced in the calling thread
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:      # the first error that is not another thread's broken barrier
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])


# ------------------------------------------------------------------------------------- cases
def cases(group: str, device, quick: bool = False) -> list[Case]:
    """The group's calls at decode / split-K sizes (bf16), inputs from ``tilefuse.testing``."""
    import tilefuse

    device = torch.device(device)
    if group == "swiglu":
        from tilefuse.testing import swiglu as sw

        # M = 4: the small-M kernel's split-K at widths 2 (I = 1024) and 4 (I = 512) by the heuristic
        shapes = [(4, 8192, 1024), (4, 16384, 512)] + ([] if quick else [(256, 2048, 1408)])
        out = []
        for m, h, i in shapes:
            x, w, _ = sw.make_case(m, h, i, DT, device)
            out.append(Case(f"x[{m},{h}] I={i}", lambda x=x, w=w: tilefuse.swiglu(x, w)))
        return out
    if group == "swiglu_fp8":
        from tilefuse.testing import swiglu as sw

        shapes = [(4, 4096, 1024, "group", "block"), (64, 2048, 1536, "token", "channel")]
        if not quick:
            shapes.append((8, 4096, 1024, "group", "block"))
        out = []
        for m, h, i, xs, ws in shapes:
            c = sw.make_fp8_case(m, h, i, device, x_scaling=xs, w_scaling=ws)
            out.append(Case(f"x[{m},{h}] I={i} {xs}/{ws}", lambda c=c: tilefuse.swiglu_fp8(*c.args())))
        if not quick:   # the FP8 epilogue: h re-quantized per 1 x 128 group
            c = sw.make_fp8_case(4, 4096, 1024, device)
            out.append(Case("x[4,4096] I=1024 -> e4m3", lambda c=c: tilefuse.swiglu_fp8(
                *c.args(), out_dtype=torch.float8_e4m3fn)))
        return out
    if group == "vq":
        from tilefuse.testing import vq as vqc

        # same N, different K (K slices 8 and 28), decode sizes
        shapes = [(1, 4096, 4096), (4, 4096, 14336)] + ([] if quick else [(16, 11008, 4096)])
        out = []
        for m, n, k in shapes:
            c = vqc.make_case(m, n, k, DT, device, bias=True)
            out.append(Case(f"x[{m},{k}] N={n}", lambda c=c: tilefuse.vq_matmul(*c.args())))
        # a 2-bit MoE expert's gate/up with the SwiGLU epilogue (fused where vq_matmul picks the
        # small-layer kernel, else two vq_matmul calls on the pinned variant)
        gate = vqc.make_case(2, 768, 2048, DT, device)
        up_codes, up_books, up_scales = vqc.make_weight(768, 2048, DT, device)
        out.append(Case("vq_swiglu x[2,2048] N=768", lambda g=gate, c=up_codes, b=up_books, s=up_scales:
                        tilefuse.vq_swiglu(g.x, g.codes, g.codebooks, g.scales, c, b, s)))
        # 2-bit MoE experts, routing read on the device (its own kernels whatever variant is pinned)
        moe = vqc.make_moe_case(4, 8, 32, 2048, 768, DT, device)
        out.append(Case("vq_moe x[4,2048] E=32 top-8", lambda c=moe: tilefuse.vq_moe(*c.args())))
        return out
    if group in ("mla", "mla_fp8"):
        from tilefuse.testing import mla as mc

        fp8 = group == "mla_fp8"
        shapes = [([3000, 70, 0, 9000], 1, 16), ([3000, 70, 0, 9000], 1, 128)]   # second-launch / fused combine
        if not quick:
            shapes.append(([5000, 1, 640], 2, 16))
        out = []
        for lens, s_q, h_q in shapes:
            inp = mc.make_case(lens, s_q, h_q, DT, device, nan_tail=not fp8)
            cache = tilefuse.mla_quantize_kv(inp.k_cache) if fp8 else inp.k_cache

            def call(inp=inp, cache=cache, s_q=s_q, h_q=h_q):
                meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
                return tilefuse.flash_mla_with_kvcache(inp.q, cache, inp.block_table, inp.cache_seqlens, 512, meta,
                                                       splits, causal=True, is_fp8_kvcache=fp8)
            out.append(Case(f"lens={lens} s_q={s_q} h_q={h_q}", call))
        return out
    if group == "mla_sparse":
        from tilefuse.testing.mla import sparse_indices
        from tilefuse.testing import mla as mc

        shapes = [([8192, 3000, 8192, 100], 1, 16, 2048), ([8192, 3000], 2, 128, 2048)]
        if not quick:
            shapes.append(([4096, 700, 4096, 64], 1, 64, 1024))
        out = []
        for lens, s_q, h_q, topk in shapes:
            gen = torch.Generator().manual_seed(h_q * 10 + s_q)
            inp = mc.make_case(lens, s_q, h_q, DT, device, nan_tail=False)
            cache = tilefuse.mla_quantize_kv(inp.k_cache)
            idx, length = sparse_indices(lens, s_q, topk, inp.block_table, inp.k_cache.shape[1], gen)
            sink = torch.randn(h_q, generator=gen).to(device)
            out.append(Case(f"lens={lens} s_q={s_q} h_q={h_q} topk={topk}",
                            lambda q=inp.q, c=cache, i=idx, n=length, s=sink: tilefuse.flash_mla_with_kvcache(
                                q, c, None, None, 512, None, None, is_fp8_kvcache=True, indices=i, topk_length=n,
                                attn_sink=s)))
        return out
    raise ValueError(f"group: expected one of {tuple(GROUPS)}, got {group!r}")


def pairs(n: int) -> list[tuple[int, int]]:
    """Which cases run side by side: the first with itself, then each with the next."""
    return [(0, 0)] + [(i, i + 1) for i in range(n - 1)]


# ------------------------------------------------------------------------------------- pinning
def skip_reason(group: str, variant: str, device) -> str | None:
    """Why ``variant`` of ``group`` cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA GPU (CUDA streams and graphs)"
    family = GROUPS[group]
    if variant == "default":
        return None
    if variant in EXTRA_PINS.get(group, ()):
        from tilefuse.ops.mla import op

        return None if op.wgmma_usable(device) else "needs a Hopper GPU with Gluon (the sparse paths' pick)"
    status = importlib.import_module(FAMILIES[family].op_module).kernel_status(device).get(variant, "not reported")
    return None if status.startswith("ok") else status


@contextlib.contextmanager
def process_pin(group: str, variant: str) -> Iterator[None]:
    """The part of a pin that is process-wide (configs): entered once, in the calling thread."""
    if variant not in EXTRA_PINS.get(group, ()):
        yield
        return
    from tilefuse.ops.mla import configs

    saved = configs.SPARSE_GATHER_DENSE
    configs.SPARSE_GATHER_DENSE = variant == "gather_dense"
    try:
        yield
    finally:
        configs.SPARSE_GATHER_DENSE = saved


def thread_pin(group: str, variant: str):
    """The thread-local part of a pin: ``tilefuse.force`` of a registry variant (every thread
    that calls must enter it)."""
    from tilefuse._backend import force

    if variant == "default" or variant in EXTRA_PINS.get(group, ()):
        return contextlib.nullcontext()
    return force(variant=variant, family=GROUPS[group])


def _stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _sync(stream):
    if stream is not None:
        stream.synchronize()


# ------------------------------------------------------------------------------------- modes
# Each mode enqueues every call's check behind it on its stream and synchronizes only at its end
# (:class:`Tally`), so the rounds run back to back and the two sides overlap for the whole mode.
def _side_streams(device: torch.device) -> list:
    streams = [_stream(device), _stream(device)]
    for s in streams:
        if s is not None:
            s.wait_stream(torch.cuda.current_stream(device))    # the inputs are ready
    return streams


def mode_streams(cases_: list[Case], tally: Tally, pin, iters: int, reps: int, device) -> None:
    """One thread, two streams: per pair and round, the two sides' calls alternate between the
    streams, ``reps`` each."""
    streams = _side_streams(device)
    with pin():
        for _ in range(iters):
            for pair in pairs(len(cases_)):
                for _ in range(reps):
                    for s, index in zip(streams, pair):
                        with _on(s):
                            tally.check(index, cases_[index].call())
    for s in streams:
        _sync(s)


def mode_threads(cases_: list[Case], tally: Tally, pin, iters: int, reps: int, device) -> None:
    """Two Python threads, a stream each, starting each pair's round together (a barrier), each
    calling its side of the pair ``reps`` times."""
    barrier = threading.Barrier(2)
    streams = _side_streams(device)

    def work(side: int):
        try:
            with pin(), _on(streams[side]):
                for _ in range(iters):
                    for pair in pairs(len(cases_)):
                        barrier.wait()
                        for _ in range(reps):
                            tally.check(pair[side], cases_[pair[side]].call())
            _sync(streams[side])
        except BaseException:
            barrier.abort()        # the other thread stops waiting
            raise

    run_threads(work)


def mode_graphs(cases_: list[Case], tally: Tally, pin, iters: int, reps: int, device) -> None:
    """Per pair, two CUDA graphs, each captured on its own with ``torch.cuda.graph`` (``reps``
    calls of its side), then replayed at once on two streams ``iters`` times, each replay's
    outputs checked on its stream before the next replay overwrites them. The expected outputs
    here are each call's own graph replayed alone (a dispatch may pick another path under capture:
    the sparse MLA decode's cost model drops the eager host floor)."""
    if device.type != "cuda":
        raise _Skip("CUDA graphs need a CUDA GPU")
    with pin():
        alone = []
        for case in cases_:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = case.call()
            graph.replay()
            torch.cuda.synchronize(device)
            alone.append(tuple(t.clone() for t in _flat(out)))
            del graph, out
        tally.expected = alone
        for pair in pairs(len(cases_)):
            graphs = []
            for index in pair:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [cases_[index].call() for _ in range(reps)]
                graphs.append((graph, index, outs))
            streams = _side_streams(device)
            for _ in range(iters):
                for s, (graph, index, outs) in zip(streams, graphs):
                    with torch.cuda.stream(s):
                        graph.replay()
                        for out in outs:
                            tally.check(index, out)
            for s in streams:
                s.synchronize()
            del graphs


def mode_after(cases_: list[Case], tally: Tally, pin, iters: int, reps: int, device) -> None:
    """Each call alone once more, after everything else (state left dirty shows here)."""
    with pin():
        for index, case in enumerate(cases_):
            tally.check(index, case.call())


MODE_RUNNERS = {"streams": mode_streams, "threads": mode_threads, "graphs": mode_graphs, "after": mode_after}


class _Skip(Exception):
    """A mode that cannot run here (its message says why)."""


def run_variant(group: str, variant: str, cases_: list[Case], device, *, iters: int, reps: int,
                modes: tuple[str, ...] = MODES) -> list[Row]:
    """Every mode of one pinned variant: the calls alone first (the expected outputs), then each
    mode, one :class:`Row` per mode. A case the op refuses (``ValueError``) is left out with its
    reason in the rows; the variant is skipped if it refuses all."""
    device = torch.device(device)
    rows = [Row(group, variant, mode) for mode in modes]
    run, refused, expected = [], [], []
    start = time.perf_counter()
    with process_pin(group, variant), thread_pin(group, variant):
        for case in cases_:
            try:
                out = case.call()
            except ValueError as exc:
                refused.append(f"{case.name}: {exc}")
                continue
            except Exception as exc:  # the call fails alone: every mode of this variant is an error
                for row in rows:
                    row.status, row.reason = "error", f"{case.name} alone: {type(exc).__name__}: {exc}"
                return rows
            run.append(case)
            expected.append(tuple(t.clone() for t in _flat(out)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    note = "; ".join(f"refused {r}" for r in refused)
    for row in rows:
        row.cases = [c.name for c in run]
        row.reason = note
    if not run:
        for row in rows:
            row.status, row.reason = "skipped", note
        return rows
    with process_pin(group, variant):
        for row in rows:
            tally = Tally(expected, exact(group, variant))
            start = start if row is rows[0] else time.perf_counter()
            try:
                MODE_RUNNERS[row.mode](run, tally, lambda: thread_pin(group, variant), iters, reps, device)
            except _Skip as exc:
                row.status, row.reason = "skipped", str(exc)
                continue
            except Exception as exc:  # reported, and the command fails
                row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"
            finally:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row.seconds = round(time.perf_counter() - start, 3)
            try:
                tally.flush()
            except Exception as exc:  # the device failed: the checks cannot be read back
                if row.status == "ok":
                    row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"
            row.calls, row.wrong, row.max_err = tally.calls, tally.wrong, tally.max_err
            if row.status == "ok" and row.wrong:
                row.status = "wrong"
    return rows


def run(groups: tuple[str, ...] | None = None, variants_: tuple[str, ...] | None = None, *, quick: bool = False,
        iters: int | None = None, reps: int | None = None, device=None, log=None) -> list[Row]:
    """The stress of ``groups`` (default: all) at ``variants_`` (default: each group's
    :func:`variants`; names a group lacks are skipped for it); ``iters`` rounds of ``reps`` calls
    per stream (defaults 25 x 4; ``quick`` 8 x 2). Returns one :class:`Row` per group, variant and
    mode; ``log(rows)`` is called with each variant's rows as it finishes."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    iters = iters or (8 if quick else 25)
    reps = reps or (2 if quick else 4)
    rows = []
    for group in groups or tuple(GROUPS):
        if group not in GROUPS:
            raise ValueError(f"groups: expected names from {tuple(GROUPS)}, got {group!r}")
        built = None
        for variant in variants(group):
            if variants_ is not None and variant not in variants_:
                continue
            why = skip_reason(group, variant, device)
            if why is None and built is None:
                torch.manual_seed(0)
                built = cases(group, device, quick)
            new = ([Row(group, variant, mode, status="skipped", reason=why) for mode in MODES] if why is not None
                   else run_variant(group, variant, built, device, iters=iters, reps=reps))
            if log is not None:
                log(new)
            rows.extend(new)
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def failed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status in ("wrong", "error")]


# ------------------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tilefuse stress``'s options (the command line in ``tilefuse.cli``)."""
    from tilefuse.cli import positive_int

    parser.add_argument("--quick", action="store_true", help="two shapes per group, 8 rounds of 2 calls per stream")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON to this file")
    parser.add_argument("--group", action="append", choices=tuple(GROUPS), default=None, metavar="GROUP",
                        help=f"only these groups (repeatable): {', '.join(GROUPS)}")
    parser.add_argument("--variant", action="append", default=None, metavar="NAME",
                        help="only these variants (repeatable): default, a family's force() variant, "
                             + ", ".join(v for extra in EXTRA_PINS.values() for v in extra))
    parser.add_argument("--iters", type=positive_int, default=None, help="rounds per mode (default 25; 8 with --quick)")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help="calls per stream in each round (default 4; 2 with --quick)")


HEADER = f"{'group':<11} {'variant':<13} " + " ".join(f"{m:>9}" for m in MODES) + "      s  (wrong/compared per mode)"


def format_rows(rows: list[Row]) -> str:
    """One variant's rows as one line of the table: ``wrong/compared`` per mode, then what went
    wrong (the largest difference), what errored or why it was skipped."""
    first = rows[0]
    if all(r.status == "skipped" for r in rows):
        return f"{first.group:<11} {first.variant:<13} skipped: {first.reason}"
    cells = " ".join(f"{'skip' if r.status == 'skipped' else f'{r.wrong}/{r.calls}':>9}" for r in rows)
    notes = [f"{r.mode}: {r.wrong} wrong, max |diff| {r.max_err:.3g}" for r in rows if r.wrong]
    notes += [f"{r.mode}: {r.status} {r.reason}" for r in rows if r.status in ("error", "skipped")]
    if not notes and first.reason:
        notes.append(first.reason)
    seconds = sum(r.seconds for r in rows)
    return f"{first.group:<11} {first.variant:<13} {cells} {seconds:6.1f}" + (f"  {'; '.join(notes)}" if notes else "")


def main(args: argparse.Namespace) -> int:
    """Run ``tilefuse stress``: 0 when every output matched, 1 when one did not or a call failed,
    or when nothing could run here (no CUDA GPU)."""
    groups = tuple(args.group) if args.group else tuple(GROUPS)
    known = {v for g in groups for v in variants(g)}
    unknown = sorted(set(args.variant or ()) - known)
    if unknown:
        print(f"tilefuse stress: --variant: expected names from {sorted(known)}, got {unknown}", file=sys.stderr)
        return 2
    print(HEADER)
    start = time.perf_counter()
    rows = run(groups, tuple(args.variant) if args.variant else None, quick=args.quick, iters=args.iters,
               reps=args.reps, log=lambda new: print(format_rows(new), flush=True))
    seconds = time.perf_counter() - start
    bad, ran = failed(rows), [r for r in rows if r.status != "skipped"]
    print(f"{sum(r.calls for r in rows)} outputs compared, {sum(r.wrong for r in rows)} wrong, "
          f"{sum(r.status == 'error' for r in rows)} errors; {len({(r.group, r.variant) for r in ran})} variants ran, "
          f"{len({(r.group, r.variant) for r in rows if r.status == 'skipped'} - {(r.group, r.variant) for r in ran})} "
          f"skipped; {seconds:.1f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report(rows, args.quick, seconds), indent=1) + "\n")
        print(f"wrote {args.out}")
    if not ran:
        print("tilefuse stress: nothing ran here (every row skipped)", file=sys.stderr)
        return 1
    return 1 if bad else 0


def report(rows: list[Row], quick: bool, seconds: float) -> dict:
    """The JSON ``--out`` writes: the machine, the versions and the rows."""
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "quick": quick, "seconds": round(seconds, 1), "wrong": sum(r.wrong for r in rows),
            "errors": sum(r.status == "error" for r in rows), "rows": [asdict(r) for r in rows]}
