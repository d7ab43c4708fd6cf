"""Timing, ceilings and result rows shared by every family's benchmark.

A family module (``tilefuse/bench/<family>.py``) exposes ``cases(device, quick) -> list[Case]``.
Each :class:`Case` names its parameters, counts its FLOPs and its minimum HBM bytes, and builds
its implementations lazily (``setup()`` allocates the inputs on the device and returns
``{impl_name: zero-arg callable}``), so only one case's tensors are alive at a time.

Timing (GPU): median of CUDA-event timings with the L2 flushed before every call
(``triton.testing.do_bench``). Cases marked ``graph=True`` (decode-sized) are also captured in a
CUDA graph and timed as replays, the way serving engines run them, and the host time to issue
one eager call is reported beside. On a CPU the same loop times with ``time.perf_counter``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Case:
    """One benchmark case of a family.

    params: the case as it goes into the JSON (e.g. ``{"model", "H", "I", "M", "dtype"}``).
    flops, bytes: work and minimum device-memory traffic (each input read once, output written once).
    setup: allocates inputs, returns ``{impl: fn}``; ``impl`` is ``"tilefuse"``,
        ``"tilefuse:<variant>"`` or a baseline's name. Leave out what does not apply (a peer
        library that is not importable, a variant that does not fit the shape); a fn that
        raises is recorded as an error row.
    graph: also time CUDA-graph replay (decode-sized cases).
    extras: optional ``fn(impls) -> {impl: {key: value}}`` adding accuracy columns to rows.
    """

    params: dict
    flops: float
    bytes: float
    setup: Callable[[], dict[str, Callable[[], object]]]
    graph: bool = False
    extras: Callable[[dict], dict] | None = None


@dataclass
class Ceilings:
    copy_gbps: float           # device-to-device copy, bytes read + written per second / 1e9
    gemm_bf16_tflops: float    # large bf16 GEMM through torch (cuBLAS)

    def roofline_us(self, flops: float, nbytes: float) -> float:
        """max(compute time, memory time) in microseconds."""
        t_compute = flops / (self.gemm_bf16_tflops * 1e12) if self.gemm_bf16_tflops else 0.0
        t_memory = nbytes / (self.copy_gbps * 1e9) if self.copy_gbps else 0.0
        return 1e6 * max(t_compute, t_memory)


@dataclass
class Timer:
    """Times zero-arg callables on ``device``; ``rep_ms`` bounds each measurement."""

    device: torch.device
    rep_ms: float = 40.0
    warmup_ms: float = 10.0
    timings: dict = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def median_us(self, fn: Callable[[], object]) -> float:
        """Median time of one call, cold L2, in microseconds."""
        if self.on_gpu:
            from triton.testing import do_bench

            return 1e3 * do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        fn()
        samples = []
        deadline = time.perf_counter() + self.rep_ms / 1e3
        while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 100):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(samples)

    def graph_us(self, fn: Callable[[], object]) -> float:
        """Median time of one CUDA-graph replay of ``fn`` (cold L2), in microseconds."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the capture (compilation, workspace allocation)
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.median_us(graph.replay)

    def host_us(self, fn: Callable[[], object], calls: int = 50) -> float:
        """Host time to issue one eager call (no synchronisation inside the loop)."""
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return 1e6 * (t1 - t0) / calls


def best_us(row: dict) -> float | None:
    """A result row's time as a serving engine sees it: the better of eager and CUDA-graph replay."""
    times = [t for t in (row.get("median_us"), row.get("graph_us")) if t]
    return min(times) if times else None


def geomean(values) -> float | None:
    """Geometric mean of positive numbers (None for none)."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """Copy bandwidth (read + write) and bf16 GEMM rate, measured now on ``device``."""
    if device.type != "cuda":
        return Ceilings(copy_gbps=0.0, gemm_bf16_tflops=0.0)
    timer = Timer(device, rep_ms=100.0 if not quick else 40.0)
    nbytes = 2 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_us = timer.median_us(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    gemm_us = timer.median_us(lambda: a @ b)
    del a, b
    return Ceilings(copy_gbps=2 * nbytes / copy_us / 1e3, gemm_bf16_tflops=2 * n ** 3 / gemm_us / 1e6)


def run_case(case: Case, family: str, timer: Timer, ceilings: Ceilings) -> list[dict]:
    """Time every implementation of ``case``; one result row per implementation."""
    rows = []
    impls = case.setup()
    extras = {}
    if case.extras is not None:
        try:
            extras = case.extras(impls)
        except Exception as exc:  # an accuracy check must not hide the timings
            extras = {name: {"extras_error": f"{type(exc).__name__}: {exc}"} for name in impls}
    roofline = ceilings.roofline_us(case.flops, case.bytes)
    for impl, fn in impls.items():
        row = {"family": family, "impl": impl, "params": dict(case.params)}
        try:
            us = timer.median_us(fn)
            row.update(median_us=us, tflops=case.flops / us / 1e6, gbps=case.bytes / us / 1e3)
            if case.graph and timer.on_gpu:
                row["graph_us"] = timer.graph_us(fn)
                row["host_us"] = timer.host_us(fn)
            best = min(row["median_us"], row.get("graph_us", math.inf))
            if roofline:
                row["roofline_frac"] = roofline / best
        except Exception as exc:  # record and go on: one failing impl must not stop the run
            row.update(median_us=None, tflops=None, gbps=None, error=f"{type(exc).__name__}: {exc}"[:300])
        row.update(extras.get(impl, {}))
        rows.append(row)
    del impls
    if timer.on_gpu:
        torch.cuda.empty_cache()
    return rows
