"""``tilefuse bench corpus``: SwiGLU and 2-bit VQ on every shape of the corpus, against what a user had.

The cases are :mod:`tilefuse.testing.corpus`'s (public model configs, tensor-parallel shards,
1-16384 tokens; ``--quick``: its fixed subsample ``quick_cases``), each timed eager and by graph
replay with its baselines in the same run (:mod:`tilefuse.bench.harness`).

Implementations per case:

* ``swiglu`` cases (dims = (H, I), bf16): ``tilefuse`` = ``tilefuse.swiglu(x, w_gate_up)`` (default
  dispatch, merged layout); ``torch_unfused`` = ``silu(F.linear(x, Wg)) * F.linear(x, Wu)`` (what the
  user had: the baseline); ``cublas_gemm`` = the bare merged ``F.linear(x, W_gate_up)`` (the floor).
* ``vq`` cases (the corpus's ``linear`` shapes, dims = (N, K), fp16, AQLM 2x8 with random codes):
  ``tilefuse`` = ``tilefuse.vq_matmul(...)`` (default dispatch); ``fp16_dense`` = ``F.linear(x, W)``
  on the dequantized weight (what the user had: the baseline); ``dequant_cublas`` = dequantize into
  a scratch weight (``ops.vq.op.launch_dequant``) + cuBLAS into a preallocated output.

Targets (:func:`summarize`; eager ``eager_us`` and graph ``graph_us`` judged apart, each against
the baseline's time of the same kind; held-out models (``Shape.held_out``) judged and reported apart,
per token bucket (``corpus.bucket_of``)):

* swiglu: every case's time <= 1.02 x torch_unfused's (the worst ratio per bucket); geomean time
  over cublas_gemm's <= 0.97 per bucket, and no case above 1.10.
* vq: 1-16 tokens: time <= fp16_dense's; 1 token on layers with N x K >= 8M (2^23): <= 0.5 x
  fp16_dense's (2x its speed); 17-512 tokens: time <= dequant_cublas's; above 512 tokens: reported
  only.

Stdout gets a table per op, population (corpus / held-out) and bucket of those ratios (time /
baseline time), the cases that miss a goal with their speedups ("x" = baseline time / tilefuse
time) and the goals that are not met; the PNG shows each case's speedup over the user's baseline,
sorted, swiglu and vq side by side, eager and graph (:class:`tilefuse.bench.plot.SortedRatioPlot`).

Order and run time. The cases run in an order that interleaves the ops and the token buckets in
proportion (every prefix of the run is a fair subsample, so a run cut short still covers every
bucket: the runner saves the rows after each case, and ``tools/replot.py`` summarizes such a file),
and each case carries ``"slice": "i/12"``, its position modulo :data:`SLICES`: each slice is itself
a fair twelfth of the corpus. :func:`estimate_s` prices a run from each impl's roofline time (bytes
at 4.2 TB/s, FLOPs at 700 TFLOP/s) and the timer's fixed budgets (do_bench warm-up and repeats,
the >= 20 ms eager loops, graph capture), plus ~1 s of compile per distinct kernel specialization
(:data:`COMPILE_S`). Its figures (H200, at the runner's default ``--rep-ms``):

* ``--quick``: 135 cases (70 swiglu, 65 vq), about 2-3 minutes;
* full: 5252 cases (1365 swiglu, 3887 vq), about 65 minutes (about 50 at ``--rep-ms 20``): about
  6 minutes per slice (5 at ``--rep-ms 20``). Where one command is limited to minutes, run it slice
  by slice (``--only '"slice": "3/12"' --tag s3``), then :func:`merge` the files into one
  (``python -m tilefuse.bench.corpus merge OUT.json IN.json ...``), which also summarizes and plots.
  The largest case (405B's MLP at 16384 tokens, ~80 ms per call) alone takes ~6 s.

The estimate is a floor for the kernels (rooflines, not measured efficiencies) but most cases are
small, where the timer's fixed budgets (~0.25 s per impl at ``--rep-ms 50``) dominate.

``--only '"op": "vq"'`` runs one op, ``--only '"bucket": "1"'`` one bucket.

On a CPU: one case per op and token bucket from ``quick_cases``, the dims scaled down to at most
256 (multiples of 64) and the tokens to at most 1025, each impl called once on the reference path:
a pipeline check, nothing timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tilefuse.bench.harness import Case, Goal, check, compare, geomean, group_rows, ratio, tally, upgrade_rows
from tilefuse.bench.plot import SortedRatioPlot
from tilefuse.testing import corpus

OPS = ("swiglu", "vq")
CORPUS_OP = {"swiglu": "swiglu", "vq": "linear"}            # the bench's op -> the corpus's op
DIMS = {"swiglu": ("H", "I"), "vq": ("N", "K")}
DTYPE = {"swiglu": torch.bfloat16, "vq": torch.float16}
BASELINE = {"swiglu": "torch_unfused", "vq": "fp16_dense"}  # what the user had
IMPLS = {"swiglu": ("tilefuse", "torch_unfused", "cublas_gemm"), "vq": ("tilefuse", "fp16_dense", "dequant_cublas")}
BUCKETS = tuple(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in corpus.TOKEN_BUCKETS)
POPULATIONS = ("corpus", "held_out")
SLICES = 12
MODES = ("graph", "eager")

# targets: tilefuse time / baseline time
SWIGLU_VS_UNFUSED = 1.02        # every case (2 % for noise)
SWIGLU_GEOMEAN_VS_GEMM = 0.97   # per bucket
SWIGLU_MAX_VS_GEMM = 1.10       # every case
VQ_VS_DENSE = 1.0               # 1-16 tokens, every case
VQ_DECODE_LARGE = 0.5           # 1 token, N x K >= VQ_LARGE_NK: at least 2x fp16's speed
VQ_LARGE_NK = 1 << 23           # "8M" weights
VQ_VS_DEQUANT = 1.0             # 17-512 tokens, every case
VQ_DENSE_MAX_TOKENS, VQ_DEQUANT_MAX_TOKENS = 16, 512

# run-time estimate (estimate_s): an H200's rates and the timer's fixed costs
HBM_BYTES_PER_S, GEMM_FLOPS_PER_S = 4.2e12, 700e12
LAUNCH_S = 5e-6                 # least time of one call
IMPL_OVERHEAD_S = 0.03          # syncs, graph capture and instantiation, the allocator per impl
SETUP_BYTES_PER_S = 0.5e12      # random inputs (and the VQ case's dense weight) written at setup
COMPILE_S = 1.0                 # per distinct kernel specialization
SPECIALIZATIONS = 30            # assumed per op: variants x tile configs x alignment classes, not per shape


# ----------------------------------------------------------------------------- the case list
def _params(op: str, shape: corpus.Shape, tokens: int, dims: tuple[int, int] | None = None) -> dict:
    a, b = dims or shape.dims
    names = DIMS[op]
    params = {"op": op, "model": shape.model, "role": shape.role, "tp": shape.tp, "held_out": shape.held_out,
              "bucket": corpus.bucket_of(tokens), "tokens": tokens, "dims": f"{a}x{b}", names[0]: a, names[1]: b,
              "dtype": str(DTYPE[op]).replace("torch.", "")}
    if dims is not None:
        params["scaled_from"] = "x".join(map(str, shape.dims))
    return params


def plan(quick: bool) -> list[dict]:
    """The params of every GPU case, in run order: both ops and every token bucket interleaved in
    proportion (each (op, bucket) group's j-th of n cases runs at fraction (j + 1/2) / n of the run;
    within a group the corpus's order: models in the corpus's order, their shards, their tokens),
    each with its ``"slice"``. Deterministic: the same list on every machine."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for op in OPS:
        pairs = corpus.quick_cases(CORPUS_OP[op]) if quick else corpus.cases(CORPUS_OP[op])
        for shape, tokens in pairs:
            groups.setdefault((corpus.bucket_of(tokens), op), []).append(_params(op, shape, tokens))
    order = sorted(((j + 0.5) / len(items), g, j) for g, items in enumerate(groups.values()) for j in range(len(items)))
    members = list(groups.values())
    out = [members[g][j] for _, g, j in order]
    for i, params in enumerate(out):
        params["slice"] = f"{i % SLICES}/{SLICES}"
    return out


def _toy(d: int) -> int:
    """A corpus dim scaled down for the CPU: 64-256 in steps of 64, growing with d."""
    return 64 * min(4, max(1, d // 2048))


def cpu_plan() -> list[dict]:
    """The CPU pipeline check: per op and bucket the first quick case of a shape not yet taken
    (five shapes per op), dims scaled by :func:`_toy`, tokens capped at 1025 (the bucket kept:
    1025 is in the last one)."""
    out = []
    for op in OPS:
        buckets, shapes = set(), set()
        for shape, tokens in corpus.quick_cases(CORPUS_OP[op]):
            bucket = corpus.bucket_of(tokens)
            if bucket not in buckets and shape not in shapes:
                buckets.add(bucket)
                shapes.add(shape)
                out.append(_params(op, shape, min(tokens, 1025), tuple(_toy(d) for d in shape.dims)))
    return out


def _swiglu_case(params: dict, device: torch.device) -> Case:
    h, i, m, dtype = params["H"], params["I"], params["tokens"], DTYPE["swiglu"]

    def setup():
        import tilefuse
        from tilefuse.testing.swiglu import make_case

        x, w, _ = make_case(m, h, i, dtype, device)
        w_gate, w_up = w[:i], w[i:]        # two contiguous [I, H] weights, as a two-GEMM MLP holds them
        return {"tilefuse": lambda: tilefuse.swiglu(x, w),
                "torch_unfused": lambda: F.silu(F.linear(x, w_gate)) * F.linear(x, w_up),
                "cublas_gemm": lambda: F.linear(x, w)}

    flops, nbytes = _work(params)["tilefuse"]
    return Case(params=params, flops=flops, bytes=nbytes, setup=setup)


def _vq_case(params: dict, device: torch.device) -> Case:
    n, k, m, dtype = params["N"], params["K"], params["tokens"], DTYPE["vq"]

    def setup():
        import tilefuse
        from tilefuse.ops.vq.reference import dequantize
        from tilefuse.testing.vq import make_case

        c = make_case(m, n, k, dtype, device)
        w = dequantize(c.codes, c.codebooks, c.scales, dtype=dtype)
        impls = {"tilefuse": lambda: tilefuse.vq_matmul(c.x, c.codes, c.codebooks, c.scales),
                 "fp16_dense": lambda: F.linear(c.x, w)}
        if device.type == "cuda":
            from tilefuse.ops.vq.op import launch_dequant

            out = torch.empty(m, n, dtype=dtype, device=device)
            impls["dequant_cublas"] = lambda: launch_dequant(c.x, c.codes, c.codebooks, c.scales, None, out)
        else:   # the Triton dequantize kernel needs a GPU: the reference's
            impls["dequant_cublas"] = lambda: F.linear(c.x, dequantize(c.codes, c.codebooks, c.scales, dtype=dtype))
        return impls

    flops, nbytes = _work(params)["tilefuse"]
    return Case(params=params, flops=flops, bytes=nbytes, setup=setup)


def cases(device: torch.device, quick: bool, subset: bool = False) -> list[Case]:
    """:func:`plan`'s cases on a GPU (and its time estimate on stderr), :func:`cpu_plan`'s on a CPU.
    ``subset`` (an ``--only`` run) changes nothing here."""
    on_gpu = device.type == "cuda"
    params = plan(quick) if on_gpu else cpu_plan()
    if on_gpu and not subset:
        counts = ", ".join(f"{op} {sum(p['op'] == op for p in params)}" for op in OPS)
        rep = 20.0 if quick else 50.0
        print(f"corpus: {len(params)} cases ({counts}), {SLICES} slices; estimated {estimate_s(params, rep) / 60:.0f} "
              f"min at the default --rep-ms {rep:g} (H200 rooflines, compile included)", file=sys.stderr)
    build = {"swiglu": _swiglu_case, "vq": _vq_case}
    return [build[p["op"]](p, device) for p in params]


# ----------------------------------------------------------------------------- run-time estimate
def _work(params: dict) -> dict[str, tuple[float, float]]:
    """(FLOPs, minimum bytes) of each impl of a case: every input read once, every output (and
    intermediate) written once and read back where a later launch reads it."""
    m = params["tokens"]
    if params["op"] == "swiglu":
        h, i, s = params["H"], params["I"], 2
        flops = 4.0 * m * i * h
        return {"tilefuse": (flops, s * (m * h + 2 * i * h + m * i)),
                # two GEMMs (x read twice, gate and up written), silu (read, write), mul (read 2, write 1)
                "torch_unfused": (flops, s * (2 * m * h + 2 * i * h + 7 * m * i)),
                "cublas_gemm": (flops, s * (m * h + 2 * i * h + 2 * m * i))}
    n, k, s = params["N"], params["K"], 2
    flops = 2.0 * m * n * k
    io = s * (m * k + m * n)
    codes = n * k / 4 + n * s + 2 * 256 * 8 * s
    return {"tilefuse": (flops, codes + io),
            "fp16_dense": (flops, s * n * k + io),
            "dequant_cublas": (flops, codes + 2 * s * n * k + io)}


def _impl_s(t: float, rep_ms: float, warmup_ms: float = 10.0, eager_ms: float = 20.0) -> float:
    """Seconds the harness spends on one impl whose call takes ``t`` seconds: do_bench (5 calls to
    estimate, then warm-up and repeats of at least one call each) for gpu_us and again for
    graph_us (after 2 warm-up calls and the capture), the eager loops (a calibration that ends
    with a loop of >= eager_ms, then two more), and a fixed overhead."""
    rep, warm, eager = rep_ms / 1e3, warmup_ms / 1e3, eager_ms / 1e3
    do_bench = 5 * t + max(t, warm) + max(t, rep)
    return 2 * do_bench + 3 * t + t + 4 * max(t, eager) + IMPL_OVERHEAD_S


def estimate_s(params_list: list[dict], rep_ms: float = 50.0, specializations: int = SPECIALIZATIONS) -> float:
    """Expected wall time of a run of these cases on an H200, in seconds (see the module docstring)."""
    total = COMPILE_S * specializations * len({p["op"] for p in params_list})
    for params in params_list:
        work = _work(params)
        for flops, nbytes in work.values():
            total += _impl_s(max(flops / GEMM_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) + LAUNCH_S, rep_ms)
        total += max(nbytes for _, nbytes in work.values()) / SETUP_BYTES_PER_S
    return total


# ----------------------------------------------------------------------------- summary
KEYS = ("op", "model", "role", "tp", "dims", "tokens")


def label(params: dict) -> str:
    """``"swiglu 7168x2048 M=333 (deepseek-v3 expert tp1)"``."""
    return f"{params['op']} {params['dims']} M={params['tokens']} ({params['model']} {params['role']} tp{params['tp']})"


def _large(params: dict) -> bool:
    return params["op"] == "vq" and params["N"] * params["K"] >= VQ_LARGE_NK


def case_goals(params: dict, time_over: dict) -> list[dict]:
    """The per-case checks of one case, graph then eager; ``time_over[mode][baseline]`` is
    tilefuse's time over that baseline's (None where either is missing)."""
    goals = []
    m = params["tokens"]
    for mode in MODES:
        r = time_over[mode]
        if params["op"] == "swiglu":
            goals += [check(f"{mode}: tilefuse / torch_unfused time", r["torch_unfused"], "<=", SWIGLU_VS_UNFUSED),
                      check(f"{mode}: tilefuse / cublas_gemm time", r["cublas_gemm"], "<=", SWIGLU_MAX_VS_GEMM)]
            continue
        if m <= VQ_DENSE_MAX_TOKENS:
            goals.append(check(f"{mode}: tilefuse / fp16_dense time", r["fp16_dense"], "<=", VQ_VS_DENSE))
        if m == 1 and _large(params):
            goals.append(check(f"{mode}: tilefuse / fp16_dense time, 1 token, N*K >= 8M", r["fp16_dense"], "<=",
                               VQ_DECODE_LARGE))
        if VQ_DENSE_MAX_TOKENS < m <= VQ_DEQUANT_MAX_TOKENS:
            goals.append(check(f"{mode}: tilefuse / dequant_cublas time", r["dequant_cublas"], "<=", VQ_VS_DEQUANT))
    return goals


def _worst(entries: list[dict], mode: str, baseline: str) -> tuple[float | None, str | None]:
    """The largest time ratio over ``baseline`` among ``entries`` and its case's label."""
    judged = [(e["time_over"][mode][baseline], e["case"]) for e in entries if e["time_over"][mode][baseline]]
    return max(judged) if judged else (None, None)


def _bucket_stats(op: str, entries: list[dict], mode: str) -> dict:
    """The ratios of one (op, population, bucket, mode): tilefuse time over each baseline's."""
    def ratios(base: str) -> list[float]:
        return [e["time_over"][mode][base] for e in entries if e["time_over"][mode][base]]

    if op == "swiglu":
        worst, worst_case = _worst(entries, mode, "torch_unfused")
        gemm = ratios("cublas_gemm")
        return {"cases": len(ratios("torch_unfused")), "worst_over_torch_unfused": worst, "worst_case": worst_case,
                "geomean_over_cublas_gemm": geomean(gemm), "max_over_cublas_gemm": max(gemm, default=None)}
    judged_dequant = [e for e in entries if VQ_DENSE_MAX_TOKENS < e["params"]["tokens"] <= VQ_DEQUANT_MAX_TOKENS]
    large_decode = [e for e in entries if e["params"]["tokens"] == 1 and _large(e["params"])]
    worst, worst_case = _worst(entries, mode, "fp16_dense")
    worst_dq, worst_dq_case = _worst(judged_dequant, mode, "dequant_cublas")
    return {"cases": len(ratios("fp16_dense")), "worst_over_fp16_dense": worst, "worst_case": worst_case,
            "geomean_over_fp16_dense": geomean(ratios("fp16_dense")),
            "worst_over_dequant_cublas_17-512": worst_dq, "worst_dequant_case": worst_dq_case,
            "geomean_over_dequant_cublas": geomean(ratios("dequant_cublas")),
            "worst_over_fp16_dense_1tok_nk>=8M": _worst(large_decode, mode, "fp16_dense")[0]}


def _bucket_goals(op: str, name: str, stats: dict, bucket: str) -> list[dict]:
    if op == "swiglu":
        return [check(f"{name}: worst tilefuse / torch_unfused time", stats["worst_over_torch_unfused"], "<=",
                      SWIGLU_VS_UNFUSED),
                check(f"{name}: geomean tilefuse / cublas_gemm time", stats["geomean_over_cublas_gemm"], "<=",
                      SWIGLU_GEOMEAN_VS_GEMM),
                check(f"{name}: max tilefuse / cublas_gemm time", stats["max_over_cublas_gemm"], "<=",
                      SWIGLU_MAX_VS_GEMM)]
    goals = []
    if bucket in ("1", "2-16"):
        goals.append(check(f"{name}: worst tilefuse / fp16_dense time", stats["worst_over_fp16_dense"], "<=",
                           VQ_VS_DENSE))
    if bucket == "1" and stats["worst_over_fp16_dense_1tok_nk>=8M"] is not None:
        goals.append(check(f"{name}: worst tilefuse / fp16_dense time at N*K >= 8M",
                           stats["worst_over_fp16_dense_1tok_nk>=8M"], "<=", VQ_DECODE_LARGE))
    if bucket in ("17-128", "129-1024"):
        goals.append(check(f"{name}: worst tilefuse / dequant_cublas time" + (" (<= 512 tokens)" if bucket != "17-128"
                                                                               else ""),
                           stats["worst_over_dequant_cublas_17-512"], "<=", VQ_VS_DEQUANT))
    return goals


def _all_met(checks: list[dict]) -> dict | None:
    """One check standing for a case's ``checks``: met if all the judged ones are (None: none judged)."""
    judged = [c["met"] for c in checks if c["met"] is not None]
    return {"met": all(judged)} if judged else None


def summarize(rows: list[dict]) -> dict:
    """The corpus's goals from one run's rows.

    Keys: ``timing``; ``cases`` (one :func:`~tilefuse.bench.harness.compare` entry per case:
    tilefuse against the user's baseline, ``torch_unfused`` or ``fp16_dense``, with ``time_over``:
    ``{mode: {baseline: tilefuse time / its time}}`` for every baseline, and ``kernel_goals``:
    :func:`case_goals`); ``buckets`` (``{op: {population: {bucket: {mode: stats}}}}``, the
    populations ``corpus`` and ``held_out``, the stats as :func:`_bucket_stats` names them, with
    the worst case's label); ``goals`` (per op and mode a tally of the per-case goals, then per op,
    population, bucket and mode the bucket's checks; a population or bucket without a case gets
    none); ``misses`` (the labels of the cases that miss a per-case goal, worst first)."""
    table = group_rows(upgrade_rows(rows), KEYS)
    cases = []
    for impls in table.values():
        params = next(iter(impls.values()))["params"]
        op = params["op"]
        entry = compare(label(params), params, impls, ("tilefuse", "tilefuse"), (BASELINE[op], BASELINE[op]))
        ours = impls.get("tilefuse") or {}
        entry["time_over"] = {mode: {base: ratio(ours.get(f"{mode}_us"), (impls.get(base) or {}).get(f"{mode}_us"))
                                     for base in IMPLS[op][1:]} for mode in MODES}
        entry["kernel_goals"] = case_goals(params, entry["time_over"])
        cases.append(entry)

    buckets: dict = {}
    goals: list[dict] = []
    for op in OPS:
        mine = [e for e in cases if e["params"]["op"] == op]
        for mode in MODES:
            per_case = [_all_met([c for c in e["kernel_goals"] if c["goal"].startswith(f"{mode}:")]) for e in mine]
            if any(c is not None for c in per_case):
                goals.append(tally(f"{op} {mode}: cases that meet every per-case goal", per_case))
        for population in POPULATIONS:
            held = population == "held_out"
            group = [e for e in mine if bool(e["params"]["held_out"]) == held]
            for bucket in BUCKETS:
                entries = [e for e in group if e["params"]["bucket"] == bucket]
                if not entries:
                    continue
                for mode in MODES:
                    stats = _bucket_stats(op, entries, mode)
                    buckets.setdefault(op, {}).setdefault(population, {}).setdefault(bucket, {})[mode] = stats
                    name = f"{op} {population.replace('_', '-')} tokens {bucket} {mode}"
                    goals += _bucket_goals(op, name, stats, bucket)

    def worst_miss(e):
        return max(c["measured"] / float(c["target"].split()[1]) for c in e["kernel_goals"] if c["met"] is False)

    misses = sorted((e for e in cases if any(c["met"] is False for c in e["kernel_goals"])), key=worst_miss,
                    reverse=True)
    return {
        "timing": "eager: eager_us (back-to-back eager calls, host cost included) against each baseline's eager_us; "
                  "graph: graph_us (CUDA-graph replay, cold L2) against each baseline's graph_us",
        "cases": cases,
        "buckets": buckets,
        "goals": goals,
        "misses": [e["case"] for e in misses],
    }


# ----------------------------------------------------------------------------- stdout and plot
def _cell(stats: dict | None, key: str, bound: float | None) -> str:
    value = (stats or {}).get(key)
    if value is None:
        return "-"
    return f"{value:.3f}" + ("*" if bound is not None and value > bound else "")


COLUMNS = {   # op -> (heading, stats key, bound or None: report only)
    "swiglu": (("worst/unfused", "worst_over_torch_unfused", SWIGLU_VS_UNFUSED),
               ("geo/gemm", "geomean_over_cublas_gemm", SWIGLU_GEOMEAN_VS_GEMM),
               ("max/gemm", "max_over_cublas_gemm", SWIGLU_MAX_VS_GEMM)),
    "vq": (("worst/dense", "worst_over_fp16_dense", None),
           ("geo/dense", "geomean_over_fp16_dense", None),
           ("worst/dequant", "worst_over_dequant_cublas_17-512", VQ_VS_DEQUANT)),
}


def print_family_summary(summary: dict, file=None, max_misses: int = 25) -> None:
    """Stdout of a GPU run: per op a table of the bucket ratios (tilefuse time / baseline time,
    graph | eager; ``*`` = misses its target), the cases that miss a goal with their speedups over
    the user's baseline (baseline time / tilefuse time), the goal tallies and every goal not met."""
    file = file or sys.stdout
    print("\ncorpus: per token bucket, tilefuse time / baseline time (< 1: tilefuse faster), graph | eager; "
          "* = misses its target", file=file)
    for op, populations in summary["buckets"].items():
        cols = COLUMNS[op]
        print(f"{op:<7} {'models':<9} {'tokens':<11} {'cases':>5}  "
              + "  ".join(f"{h:>15}" for h, _, _ in cols), file=file)
        for population, per_bucket in populations.items():
            for bucket, modes in per_bucket.items():
                cells = []
                for _, key, bound in cols:
                    if op == "vq" and key == "worst_over_fp16_dense":
                        bound = VQ_VS_DENSE if bucket in ("1", "2-16") else None
                    cells.append(" | ".join(_cell(modes.get(mode), key, bound) for mode in MODES))
                n = (modes.get("graph") or modes.get("eager") or {}).get("cases", 0)
                print(f"{'':<7} {population.replace('_', '-'):<9} {bucket:<11} {n:>5}  "
                      + "  ".join(f"{c:>15}" for c in cells), file=file)
    by_label = {e["case"]: e for e in summary["cases"]}
    misses = summary["misses"]
    if misses:
        print(f"\ncases that miss a goal ({len(misses)}; eager, graph: speedup = baseline time / tilefuse time):",
              file=file)
        width = max(len(m) for m in misses[:max_misses])
        for name in misses[:max_misses]:
            e = by_label[name]
            missed = "; ".join(f"{c['goal']} {c['measured']:.3f} ({c['target']})" for c in e["kernel_goals"]
                               if c["met"] is False and c["goal"].startswith("graph:"))
            eager = sum(c["met"] is False and c["goal"].startswith("eager:") for c in e["kernel_goals"])
            missed += f"{'; ' if missed else ''}{eager} eager goal{'s' if eager != 1 else ''}" if eager else ""
            print(f"  {name:<{width}}  {e['baseline']:<13} {_speedup(e['eager_speedup']):>7} "
                  f"{_speedup(e['graph_speedup']):>7}  missed: {missed}", file=file)
        if len(misses) > max_misses:
            print(f"  ... and {len(misses) - max_misses} more (the JSON summary's misses)", file=file)
    judged = [g for g in summary["goals"] if g["met"] is not None]
    failed = [g for g in judged if g["met"] is False]
    print(f"corpus goals: {len(judged) - len(failed)} of {len(judged)} met"
          + (f", {len(summary['goals']) - len(judged)} not measured" if len(judged) < len(summary["goals"]) else ""),
          file=file)
    for goal in summary["goals"]:
        if "met_in" in goal:
            state = {True: "ok", False: "FAIL", None: "not measured"}[goal["met"]]
            print(f"  [{state}] {goal['goal']}: met in {goal['met_in']}/{goal['of']} cases", file=file)
        elif goal["met"] is False:
            print(f"  [FAIL] {goal['goal']}: {goal['measured']:.3f} (target {goal['target']})", file=file)


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


PLOT = SortedRatioPlot(
    panel="op", panels=OPS, color="bucket", colors=BUCKETS, dashed="held_out",
    goals={"swiglu": [Goal(1 / SWIGLU_VS_UNFUSED, f"goal: every case >= 1/{SWIGLU_VS_UNFUSED:g} of torch_unfused")],
           "vq": [Goal(1 / VQ_DECODE_LARGE, "goal at 1 token, N*K >= 8M: >= 2x"),
                  Goal(1.0, "goal at 1-16 tokens: >= 1x (17-512: against dequant_cublas, in the JSON)")]})


# ----------------------------------------------------------------------------- slices
def merge(out: Path, paths: list[Path]) -> dict:
    """One results file from several runs' files (e.g. the slices of a full run): the first file's
    machine, ceilings and timing, every file's rows (a case in several files: the last file's
    rows), ``merged_from``; then its summary and PNG (:func:`tilefuse.bench.runner.resummarize`).
    Returns the summary."""
    from tilefuse.bench.runner import resummarize

    files = [json.loads(Path(p).read_text()) for p in paths]
    if any(f.get("timing", {}).get("mode") == "cpu-pipeline-check" for f in files):
        raise ValueError("paths: a CPU pipeline check has no times to merge")
    rows: dict[tuple, dict] = {}
    for data in files:
        for row in data["rows"]:
            rows[(row["impl"], *(row["params"][k] for k in KEYS))] = row
    merged = {k: v for k, v in files[0].items() if k not in ("rows", "summary", "incomplete")}
    merged["merged_from"] = [str(p) for p in paths]
    merged["rows"] = list(rows.values())
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return resummarize(Path(out))[1]


def _main(argv: list[str]) -> int:
    import argparse

    from tilefuse.bench.runner import print_summary

    parser = argparse.ArgumentParser(prog="python -m tilefuse.bench.corpus",
                                     description="Merge corpus results files (the slices of a full run) into one, "
                                                 "with its summary and PNG.")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge results files into OUT")
    m.add_argument("out", type=Path)
    m.add_argument("paths", type=Path, nargs="+")
    from tilefuse._cmdline import ClosedPipeSafe

    args = parser.parse_args(argv)
    try:
        summary = merge(args.out, args.paths)
    except ValueError as exc:
        print(f"python -m tilefuse.bench.corpus: {exc}", file=sys.stderr)
        return 1
    stdout, sys.stdout = sys.stdout, ClosedPipeSafe(sys.stdout)     # `... | head` ends quietly
    try:
        print_summary("corpus", summary)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
