"""Timing, ceilings, result rows and goal checks shared by every family's benchmark.

A family module (``tilefuse/bench/<family>.py``) exposes ``cases(device, quick, subset) -> list[Case]``,
``summarize(rows) -> dict`` and ``PLOT`` (a :class:`PlotSpec`). Each :class:`Case` names its
parameters, counts its FLOPs and its minimum HBM bytes, and builds its implementations lazily
(``setup()`` allocates the inputs on the device and returns ``{impl_name: zero-arg callable}``), so
only one case's tensors are alive at a time.

Every implementation is timed three ways on a GPU, because each answers a different question:

* ``gpu_us``: median of ``triton.testing.do_bench`` over single eager calls, L2 flushed before each
  call: the GPU timeline of one call (host launch cost shows only where it exceeds the GPU work
  queued ahead of the call).
* ``eager_us``: wall clock per call of N back-to-back eager calls with one
  ``torch.cuda.synchronize()`` at the end, N such that the loop runs >= ``Timer.eager_ms`` (after a
  warm-up); median of three such loops. What an eager-mode model pays per call, host launch cost
  included. Warm L2: every call reads the same inputs.
* ``graph_us``: median replay time of a CUDA graph holding one call (captured on a side stream after
  a warm-up), L2 flushed before each replay: the kernels' time without host cost, the way serving
  engines run decode steps.

``tflops``, ``gbps`` and ``roofline_frac`` are computed from ``graph_us``. Eager and graph times
are judged separately, each against the baseline's time of the same kind, never the better of the
two. On a CPU nothing is timed: each implementation is called once on toy shapes through the
PyTorch reference path, a check of the pipeline (setup, calls, accuracy columns, results file).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from tilefuse._launch import capture_graph

# What each key of a result row means; written into every results file as "fields".
ROW_FIELDS = {
    "family": "benchmark family (swiglu, mla, vq)",
    "impl": "implementation: 'tilefuse', 'tilefuse:<variant>' (one kernel schedule forced) or a baseline's name",
    "params": "the case (shape, dtype, ...)",
    "flops": "floating-point operations of one call",
    "bytes": "minimum device-memory traffic of one call: every input read once, the output written once",
    "gpu_us": "median of triton.testing.do_bench over single eager calls, cold L2 (GPU timeline of one call)",
    "eager_us": "wall clock per call of eager_calls back-to-back eager calls, one synchronize at the end, "
                "warm L2 (host launch cost included)",
    "eager_calls": "N, the number of calls in each timed eager loop (the loop runs >= ~20 ms)",
    "graph_us": "median replay time of a CUDA graph of one call, cold L2 (kernel time without host cost)",
    "tflops": "flops / graph_us",
    "gbps": "bytes / graph_us (GB/s)",
    "roofline_frac": "roofline time / graph_us; roofline = max(flops / GEMM ceiling, bytes / copy ceiling)",
    "error": "why the implementation could not be timed (no times then), or on a CPU why its call failed",
    "graph_error": "why the CUDA-graph capture or replay failed (no graph_us and no rates then)",
}
LEGACY_NOTE = ("rows in the older schema: 'median_us' read as gpu_us; rates recomputed from graph_us "
               "(none where graph replay was not timed); eager_us was not measured")


@dataclass
class Case:
    """One benchmark case of a family.

    params: the case as it goes into the JSON (e.g. ``{"model", "H", "I", "M", "dtype"}``).
    flops, bytes: work and minimum device-memory traffic (each input read once, output written once).
    setup: allocates inputs, returns ``{impl: fn}``; ``impl`` is ``"tilefuse"``,
        ``"tilefuse:<variant>"`` or a baseline's name. Leave out what does not apply (a peer
        library that is not importable, a variant that does not fit the shape); a fn that
        raises is recorded as an error row.
    extras: optional ``fn(impls) -> {impl: {key: value}}`` adding accuracy columns to rows.
    """

    params: dict
    flops: float
    bytes: float
    setup: Callable[[], dict[str, Callable[[], object]]]
    extras: Callable[[dict], dict] | None = None


@dataclass
class Ceilings:
    copy_gbps: float | None         # device-to-device copy, bytes read + written per second / 1e9
    gemm_bf16_tflops: float | None  # large bf16 GEMM through torch (cuBLAS); both None without a GPU

    def roofline_us(self, flops: float, nbytes: float) -> float:
        """max(compute time, memory time) in microseconds (0 where no ceiling is known)."""
        t_compute = flops / (self.gemm_bf16_tflops * 1e12) if self.gemm_bf16_tflops else 0.0
        t_memory = nbytes / (self.copy_gbps * 1e9) if self.copy_gbps else 0.0
        return 1e6 * max(t_compute, t_memory)


@dataclass(frozen=True)
class Goal:
    """A goal drawn as a reference line at ``y`` in a plot panel, over the x values ``xs`` (lo, hi)
    it applies to (None: all); ``vs`` / ``not_vs``: drawn only where the panel's baseline is / is
    not that impl (e.g. a goal against a peer library)."""

    y: float
    label: str
    xs: tuple[float, float] | None = None
    vs: str | None = None
    not_vs: str | None = None


@dataclass
class PlotSpec:
    """How ``plot.py`` draws a family: one line per value of the ``line`` params (a colour each; the
    ``style`` param, if any, picks the line style) over the ``x`` param, one row of panels per value
    of ``facet``; ``roofline_if(params)`` says where the roofline fraction means something
    (decode-sized, memory-bound cases); ``goals`` maps a panel ("eager", "graph", "host",
    "roofline") to its :class:`Goal` lines."""

    x: str
    line: tuple[str, ...]
    style: str | None = None
    facet: str | None = None
    roofline_if: Callable[[dict], bool] = lambda params: True
    goals: dict[str, list[Goal]] = field(default_factory=dict)


@dataclass
class Timer:
    """Times zero-arg callables on ``device``; ``rep_ms`` bounds each do_bench measurement,
    ``eager_ms`` is the least duration of one timed eager loop, timed by ``clock`` (seconds)."""

    device: torch.device
    rep_ms: float = 40.0
    warmup_ms: float = 10.0
    eager_ms: float = 20.0
    max_eager_calls: int = 100_000
    clock: Callable[[], float] = time.perf_counter

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def gpu_us(self, fn: Callable[[], object]) -> float:
        """do_bench median of one eager call, cold L2, in microseconds (GPU only)."""
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")

    def eager_us(self, fn: Callable[[], object]) -> tuple[float, int]:
        """(wall-clock microseconds per call, N): N back-to-back calls, one synchronize at the end.

        The calibration loops (N doubling, or scaled to the target, until one loop lasts
        ``eager_ms``) are the warm-up; then the median of three loops of that N."""
        sync = torch.cuda.synchronize if self.on_gpu else (lambda: None)

        def loop(n: int) -> float:
            sync()
            t0 = self.clock()
            for _ in range(n):
                fn()
            sync()
            return self.clock() - t0

        loop(1)
        target = self.eager_ms / 1e3
        n, elapsed = 1, loop(1)
        while elapsed < target and n < self.max_eager_calls:
            n = min(self.max_eager_calls, max(2 * n, math.ceil(1.2 * n * target / max(elapsed, 1e-9))))
            elapsed = loop(n)
        samples = [elapsed, loop(n), loop(n)]
        return 1e6 * statistics.median(samples) / n, n

    def graph_us(self, fn: Callable[[], object]) -> float:
        """Median time of one CUDA-graph replay of ``fn`` (cold L2), in microseconds."""
        graph, _ = capture_graph(fn)
        try:
            return self.gpu_us(graph.replay)
        finally:
            torch.cuda.synchronize()
            del graph


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """Copy bandwidth (read + write) and bf16 GEMM rate, measured now on ``device`` (None for both
    without a GPU: nothing to measure)."""
    if device.type != "cuda":
        return Ceilings(copy_gbps=None, gemm_bf16_tflops=None)
    timer = Timer(device, rep_ms=100.0 if not quick else 40.0)
    nbytes = 2 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_us = timer.gpu_us(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    gemm_us = timer.gpu_us(lambda: a @ b)
    del a, b
    return Ceilings(copy_gbps=2 * nbytes / copy_us / 1e3, gemm_bf16_tflops=2 * n ** 3 / gemm_us / 1e6)


def rates(row: dict, roofline_us: float | None) -> dict:
    """``tflops``, ``gbps`` and ``roofline_frac`` of a row from its ``graph_us`` (None without)."""
    us = row.get("graph_us")
    if not us:
        return {"tflops": None, "gbps": None, "roofline_frac": None}
    return {"tflops": row["flops"] / us / 1e6, "gbps": row["bytes"] / us / 1e3,
            "roofline_frac": roofline_us / us if roofline_us else None}


def time_impl(fn: Callable[[], object], timer: Timer) -> dict:
    """The times of one implementation on a GPU: gpu_us, eager_us and graph_us. On a CPU ``fn`` is
    called once and nothing is timed (``{}``): the reference path says nothing about tilefuse."""
    if not timer.on_gpu:
        fn()
        return {}
    times: dict = {"gpu_us": timer.gpu_us(fn)}
    times["eager_us"], times["eager_calls"] = timer.eager_us(fn)
    try:
        times["graph_us"] = timer.graph_us(fn)
    except Exception as exc:  # not capturable: the eager times still stand
        times["graph_us"] = None
        times["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return times


def run_case(case: Case, family: str, timer: Timer, ceilings: Ceilings) -> list[dict]:
    """Time every implementation of ``case``; one result row per implementation (one error row,
    impl ``setup``, where the case's inputs cannot be built, e.g. out of memory)."""
    rows = []
    try:
        impls = case.setup()
    except Exception as exc:  # inputs that cannot be built (a cache too large for this GPU): record, go on
        if timer.on_gpu:
            torch.cuda.empty_cache()
        return [{"family": family, "impl": "setup", "params": dict(case.params), "flops": case.flops,
                 "bytes": case.bytes, "error": f"{type(exc).__name__}: {exc}"[:300]}]
    extras = {}
    if case.extras is not None:
        try:
            extras = case.extras(impls)
        except Exception as exc:  # an accuracy check must not hide the timings
            extras = {name: {"extras_error": f"{type(exc).__name__}: {exc}"} for name in impls}
    roofline = ceilings.roofline_us(case.flops, case.bytes)
    for impl, fn in impls.items():
        row = {"family": family, "impl": impl, "params": dict(case.params), "flops": case.flops,
               "bytes": case.bytes}
        try:
            row.update(time_impl(fn, timer))
            if timer.on_gpu:
                row.update(rates(row, roofline))
        except Exception as exc:  # record and go on: one failing impl must not stop the run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row.update(extras.get(impl, {}))
        rows.append(row)
    del impls
    if timer.on_gpu:
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- older rows
def upgrade_rows(rows: Iterable[dict], renames: dict[str, str] | None = None) -> list[dict]:
    """Rows of any schema in this one (new rows pass through unchanged).

    Older rows had ``median_us`` (do_bench of the eager call: this schema's ``gpu_us``), a
    ``graph_us`` for launch-bound cases only, ``host_us`` (the host time to issue a call, without
    synchronizing: not ``eager_us``, dropped) and rates from min(median_us, graph_us). Their rates
    are recomputed from ``graph_us`` alone (none where graph replay was not timed); ``eager_us``
    stays absent. ``renames`` maps an older impl name to its name now."""
    out = []
    for row in rows:
        if "median_us" not in row:
            out.append(row)
            continue
        row = dict(row)
        gpu, graph = row.pop("median_us"), row.get("graph_us")
        row.pop("host_us", None)
        row["impl"] = (renames or {}).get(row["impl"], row["impl"])
        row["gpu_us"] = gpu
        if gpu and row.get("tflops") is not None:
            row.setdefault("flops", row["tflops"] * gpu * 1e6)
            row.setdefault("bytes", row["gbps"] * gpu * 1e3)
        times = [t for t in (gpu, graph) if t]
        roofline = row["roofline_frac"] * min(times) if row.get("roofline_frac") and times else None
        if "flops" in row:
            row.update(rates(row, roofline))
        row["legacy_schema"] = True
        out.append(row)
    return out


# ----------------------------------------------------------------------------- summaries
def geomean(values) -> float | None:
    """Geometric mean of positive numbers (None for none)."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None where either is missing."""
    return num / den if num and den else None


def group_rows(rows: Iterable[dict], keys: tuple[str, ...]) -> dict[tuple, dict[str, dict]]:
    """``{(params[k] for k in keys): {impl: row}}`` in the rows' order; rows with an error are left out."""
    table: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if not row.get("error"):
            table.setdefault(tuple(row["params"][k] for k in keys), {})[row["impl"]] = row
    return table


def check(goal: str, measured: float | None, op: str, bound: float) -> dict:
    """A goal: ``{"goal", "measured", "target", "met"}``; ``met`` is None where not measured."""
    met = None if measured is None else bool(measured <= bound if op == "<=" else measured >= bound)
    return {"goal": goal, "measured": None if measured is None else round(measured, 4),
            "target": f"{op} {bound:g}", "met": met}


def tally(goal: str, checks: Iterable[dict | None]) -> dict:
    """How many of the per-case ``checks`` are met: ``{"goal", "met_in", "of", "met"}`` (``of``
    counts the measured ones; ``met`` is None where none was)."""
    judged = [c["met"] for c in checks if c and c["met"] is not None]
    return {"goal": goal, "met_in": sum(judged), "of": len(judged), "met": all(judged) if judged else None}


def compare(label: str, params: dict, impls: dict[str, dict], ours: tuple[str, str],
            baseline: tuple[str, str] | None) -> dict:
    """One case of a summary: tilefuse against a baseline, eager and graph side by side.

    ours, baseline: ``(eager impl, graph impl)``: the rows whose ``eager_us`` and ``graph_us`` are
    compared (the same impl for most families; MLA times one decode step with the metadata inside
    the graph and eager attention with the metadata precomputed).

    Keys: ``case``, ``params``, ``baseline``, ``eager_impl``, ``graph_impl``, ``eager_us``,
    ``graph_us``, ``baseline_eager_us``, ``baseline_graph_us``; ``eager_speedup`` = baseline
    eager_us / tilefuse eager_us; ``graph_speedup`` = baseline graph_us / tilefuse graph_us;
    ``eager_over_graph`` = eager impl's eager_us / its own graph_us (the host cost factor);
    ``roofline_frac`` of the graph impl; ``host_goal`` (a :func:`host_goal` check or None) and
    ``kernel_goals`` (a list of :func:`check` dicts), filled in by the family; ``legacy_schema``
    (only where true) when the rows come from an older results file (:func:`upgrade_rows`).
    """
    get = lambda impl, key: (impls.get(impl) or {}).get(key) if impl else None  # noqa: E731
    base = baseline or (None, None)
    entry = {
        "case": label, "params": params, "baseline": base[0],
        "eager_impl": ours[0], "graph_impl": ours[1],
        "eager_us": get(ours[0], "eager_us"), "graph_us": get(ours[1], "graph_us"),
        "baseline_eager_us": get(base[0], "eager_us"), "baseline_graph_us": get(base[1], "graph_us"),
    }
    entry["eager_speedup"] = ratio(entry["baseline_eager_us"], entry["eager_us"])
    entry["graph_speedup"] = ratio(entry["baseline_graph_us"], entry["graph_us"])
    entry["eager_over_graph"] = ratio(entry["eager_us"], get(ours[0], "graph_us"))
    entry["roofline_frac"] = get(ours[1], "roofline_frac")
    entry["host_goal"], entry["kernel_goals"] = None, []
    if any(row.get("legacy_schema") for row in impls.values()):
        entry["legacy_schema"] = True
    return entry


def host_goal(entry: dict, baseline_factor: float | None = None, graph_factor: float | None = None) -> dict:
    """The host-path goal of an eager call: ``eager_us <= max(baseline_factor x the baseline's
    eager_us, graph_factor x the impl's own graph_us)`` (either term may be left out).

    ``measured`` is eager_us over that limit (<= 1 meets it). Where a term is not measured (a CPU
    run, an older file) a call under the other term still meets the goal; one over it is not judged.
    """
    terms = []
    if baseline_factor:
        terms.append((f"{baseline_factor:g} x {entry['baseline']} eager_us",
                      baseline_factor * entry["baseline_eager_us"] if entry["baseline_eager_us"] else None))
    if graph_factor:
        own_graph = ratio(entry["eager_us"], entry["eager_over_graph"])
        terms.append((f"{graph_factor:g} x own graph_us", graph_factor * own_graph if own_graph else None))
    goal = f"eager_us <= {'max(' + ', '.join(t for t, _ in terms) + ')' if len(terms) > 1 else terms[0][0]}"
    limits = [v for _, v in terms if v]
    eager = entry["eager_us"]
    result = check(goal, ratio(eager, max(limits)) if limits else None, "<=", 1.0)
    if result["met"] is False and len(limits) < len(terms):
        result["met"] = None
    result["limit_us"] = max(limits) if limits else None
    return result
