"""``tilefuse bench vq``: 2-bit VQ linear (AQLM 2x8) against fp16/bf16 cuBLAS on the dequantized weight.

Codes, codebooks and scales are random (timing does not depend on their values). Impls:
``tilefuse`` (default dispatch), ``tilefuse:decode`` (the table decode, 1-4 tokens),
``tilefuse:mma`` (the MMA decode, 2-64 tokens), ``tilefuse:dequant`` (dequantize + cuBLAS, 16
tokens and up, to locate the switch point), ``tilefuse:prefill`` (the fused prefill kernel, 64
tokens and up: the WGMMA kernel on Hopper, its ``tl`` twin elsewhere), ``fp16_cublas`` (``F.linear`` on
the dequantized weight in the case's dtype: the dense layer the 2-bit one replaces), and where the
``aqlm`` package imports and its CUDA extension builds (nvcc, on first use), AQLM's own kernels
on the same codes: ``aqlm_cuda`` (its 2x8 GEMV, one launch per token; AQLM runs it up to 6
tokens) and ``aqlm_cuda_dequant`` (its dequantize + cuBLAS, above). ``bytes``
counts codes + x + out + scales (+ codebooks), so the roofline is the memory floor of the codes.

Goals (:func:`summarize`), in graph mode (kernel time, CUDA-graph replay): speedup over
``fp16_cublas`` >= 5x at 28672x8192 batch 1, >= 3x at 4096x4096 batch 1, >= 2x at 2-8 tokens on
every shape and >= 3x there at the two largest shapes, >= 1.3x at 16 tokens; at 512 tokens
tilefuse's time <= 1.15x cuBLAS's; at 1 token on layers of N x K >= 16M, >= 0.7 of the memory
floor (each case's ``floor_us``: its bytes over the copy ceiling). In eager mode at 1-16 tokens
(the host path): ``eager_us <= max(1.3 x fp16_cublas's eager_us, 1.1 x tilefuse's own graph_us)``.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from tilefuse.bench.harness import (Case, Goal, PlotSpec, check, compare, geomean, group_rows, host_goal, ratio,
                                    tally, upgrade_rows)
from tilefuse.testing.vq import SHAPES, TOKENS   # the layer shapes the tests use too

DTYPES = [torch.float16, torch.bfloat16]
BENCH_SHAPES = SHAPES + [(4096, 14336), (14336, 4096)]   # + Llama-3-8B's MLP projections
LARGEST = ("28672x8192", "8192x28672")


def vq_case(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device) -> Case:
    dense: dict = {}   # the dense layer's output, handed from setup() to extras()

    def setup():
        import tilefuse
        from tilefuse.ops.vq.reference import dequantize
        from tilefuse.testing.vq import make_case

        c = make_case(m, n, k, dtype, device)
        args = (c.x, c.codes, c.codebooks, c.scales)
        w = dequantize(c.codes, c.codebooks, c.scales, dtype=dtype)

        def forced(variant):
            def run():
                with tilefuse.force(variant=variant):
                    return tilefuse.vq_matmul(*args)
            return run

        impls = {"tilefuse": lambda: tilefuse.vq_matmul(*args)}
        if device.type == "cuda":
            if m <= 4:
                impls["tilefuse:decode"] = forced("decode")
            if 2 <= m <= 64:
                impls["tilefuse:mma"] = forced("mma")
            if m >= 16:
                impls["tilefuse:dequant"] = forced("dequant")
            if m >= 64:
                impls["tilefuse:prefill"] = forced("prefill")
        impls["fp16_cublas"] = lambda: F.linear(c.x, w)
        dense["fp16_cublas"] = impls["fp16_cublas"]
        aqlm = aqlm_cuda() if device.type == "cuda" and dtype != torch.float32 else None
        if aqlm is not None:
            codes = c.codes.view(torch.int8)       # AQLM stores codes as int8 (same bits)
            if m <= 16:
                impls["aqlm_cuda"] = lambda: aqlm.code2x8_matmat(c.x, codes, c.codebooks, c.scales, None)
            if m >= 8:
                impls["aqlm_cuda_dequant"] = lambda: aqlm.code2x8_matmat_dequant(c.x, codes, c.codebooks, c.scales,
                                                                                  None)
        return impls

    def extras(impls):
        """AQLM's outputs against the dense layer's (relative error): a layout mismatch shows here."""
        from tilefuse.testing.compare import rel_err

        ref = dense.pop("fp16_cublas")().float()
        return {name: {"rel_err_vs_dense": rel_err(fn().float(), ref)} for name, fn in impls.items()
                if name.startswith("aqlm")}

    size = 2 if dtype != torch.float32 else 4
    nbytes = n * k / 4 + (m * k + m * n) * size + n * size + 2 * 256 * 8 * size
    params = {"N": n, "K": k, "tokens": m, "dtype": str(dtype).replace("torch.", "")}
    return Case(params=params, flops=2.0 * m * n * k, bytes=nbytes, setup=setup, extras=extras)


@functools.lru_cache(maxsize=None)
def aqlm_cuda():
    """AQLM's CUDA extension (its ``code2x8_matmat`` / ``code2x8_matmat_dequant`` take tilefuse's
    layout as is: codes ``[N, K/8, 2]`` int8, codebooks ``[2, 256, 1, 8]``, scales
    ``[N, 1, 1, 1]``), or None where ``aqlm`` is not installed or its build fails (said once)."""
    try:
        from aqlm.inference_kernels.cuda_kernel import CUDA_KERNEL
    except Exception as exc:  # not installed, or nvcc / ninja missing
        print(f"bench vq: AQLM's kernels not timed ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
        return None
    return CUDA_KERNEL


def cases(device: torch.device, quick: bool, subset: bool = False) -> list[Case]:
    """The eight layer shapes x 1-512 tokens x fp16/bf16 (quick: 2 shapes x 1, 2, 8, 16, 512 tokens); tiny
    ones on a CPU. ``subset`` (an ``--only`` run) changes nothing here."""
    if device.type != "cuda":  # pipeline check on the CPU: reference path, tiny shapes
        return [vq_case(n, k, m, torch.float16, device) for n, k in [(64, 128), (96, 256)] for m in (1, 8, 32)]
    shapes = SHAPES[:1] + SHAPES[4:5] if quick else BENCH_SHAPES
    tokens = [1, 2, 8, 16, 512] if quick else TOKENS
    return [vq_case(n, k, m, dt, device) for dt in DTYPES for n, k in shapes for m in tokens]


HOST_PATH_MAX_TOKENS = 16   # the host-path goal applies at 1-16 tokens
FLOOR_GOAL = ("graph: >= 0.7 of the memory floor at 1 token on layers of N x K >= 16M", 16 << 20, 0.7)
# The kernel goals, graph mode: (name, shape or "*" for every shape, tokens, dtype or "*", least
# speedup over fp16_cublas). At 512 tokens the goal is a time within 1.3x of cuBLAS's.
SPEEDUP_GOALS = (
    ("graph speedup >= 5x at 28672x8192, 1 token", "28672x8192", 1, "*", 5.0),
    ("graph speedup >= 3x at 4096x4096, 1 token", "4096x4096", 1, "*", 3.0),
    *((f"graph speedup >= 2x at {m} tokens", "*", m, "*", 2.0) for m in (2, 4, 8)),
    *((f"graph speedup >= 3x at {m} tokens, {shape}", shape, m, "*", 3.0) for m in (2, 4, 8) for shape in LARGEST),
    ("graph speedup >= 1.3x at 16 tokens", "*", 16, "*", 1.3),
    ("prefill: graph time <= 1.15x fp16_cublas at 512 tokens", "*", 512, "*", 1 / 1.15),
)
PLOT = PlotSpec(
    x="tokens", line=("N", "K"), facet="dtype", roofline_if=lambda p: p["tokens"] <= HOST_PATH_MAX_TOKENS,
    goals={"eager": [Goal(1 / 1.3, "host goal: >= 1/1.3 (or eager <= 1.1 x graph)", xs=(1, 16))],
           "graph": [Goal(5.0, "5x goal (28672x8192)", xs=(1, 1)), Goal(3.0, "3x goal (4096x4096)", xs=(1, 1)),
                     Goal(2.0, "2x goal", xs=(2, 8)), Goal(1.3, "1.3x goal", xs=(16, 16))],
           "host": [Goal(1.1, "host goal: <= 1.1 (or eager >= 1/1.3 of cuBLAS)", xs=(1, 16))]})


def summarize(rows: list[dict]) -> dict:
    """The family's goals from one run's rows, eager and graph side by side.

    Keys: ``timing``; ``cases`` (one :func:`~tilefuse.bench.harness.compare` entry per shape x
    tokens x dtype: tilefuse against ``fp16_cublas``, with its host goal at <= 16 tokens and its
    speedup goal where it has one); ``goals`` (tallies of both); ``batch1_speedup_geomean``;
    ``switch_time_ratios`` (the switch points: the MMA decode's time over the table decode's and over
    the dequant path's; > 1 means the other is faster), ``fused_prefill_over_cublas_time`` and,
    where AQLM was timed, ``speedup_over_faster_aqlm_kernel`` (the faster of AQLM's two kernels'
    time over tilefuse's), each ``{"eager": {...}, "graph": {...}}``.
    """
    table = group_rows(upgrade_rows(rows), ("N", "K", "tokens", "dtype"))
    cases = []
    switch: dict = {"eager": {}, "graph": {}}
    fused: dict = {"eager": {}, "graph": {}}
    vs_aqlm: dict = {"eager": {}, "graph": {}}
    for (n, k, tokens, dtype), impls in table.items():
        shape = f"{n}x{k}"
        entry = compare(f"{shape} {tokens} tok {dtype}", next(iter(impls.values()))["params"], impls,
                        ("tilefuse", "tilefuse"), ("fp16_cublas", "fp16_cublas"))
        if tokens <= HOST_PATH_MAX_TOKENS:
            entry["host_goal"] = host_goal(entry, baseline_factor=1.3, graph_factor=1.1)
        entry["kernel_goals"] = [check(name, entry["graph_speedup"], ">=", bound)
                                 for name, on_shape, on_tokens, on_dtype, bound in SPEEDUP_GOALS
                                 if on_shape in (shape, "*") and on_tokens == tokens and on_dtype in (dtype, "*")]
        # the memory floor (roofline_frac is the floor's time over graph_us: the case's bytes over
        # the copy ceiling, FLOPs far below the GEMM ceiling at decode sizes)
        frac = entry["roofline_frac"]
        entry["floor_us"] = round(frac * entry["graph_us"], 2) if frac and entry["graph_us"] else None
        if tokens == 1 and n * k >= FLOOR_GOAL[1]:
            entry["kernel_goals"].append(check(FLOOR_GOAL[0], frac, ">=", FLOOR_GOAL[2]))
        cases.append(entry)
        for mode, key in (("eager", "eager_us"), ("graph", "graph_us")):
            t = {name: row.get(key) for name, row in impls.items()}
            for fast, slow in (("tilefuse:mma", "tilefuse:decode"), ("tilefuse:mma", "tilefuse:dequant")):
                if ratio(t.get(fast), t.get(slow)):
                    switch[mode].setdefault(f"{fast[9:]}/{slow[9:]} {shape} {dtype}", {})[tokens] = \
                        round(t[fast] / t[slow], 3)
            if ratio(t.get("tilefuse:prefill"), t.get("fp16_cublas")):
                fused[mode][f"{shape} {tokens} {dtype}"] = round(t["tilefuse:prefill"] / t["fp16_cublas"], 2)
            aqlm = min((t[name] for name in ("aqlm_cuda", "aqlm_cuda_dequant") if t.get(name)), default=None)
            if ratio(aqlm, t.get("tilefuse")):
                vs_aqlm[mode][f"{shape} {tokens} {dtype}"] = round(aqlm / t["tilefuse"], 2)

    batch1 = [e for e in cases if e["params"]["tokens"] == 1]
    return {
        "timing": "eager: eager_us (back-to-back eager calls, host cost included) against fp16_cublas's eager_us; "
                  "graph: graph_us (CUDA-graph replay, cold L2) against fp16_cublas's graph_us",
        "cases": cases,
        "goals": [
            *(tally(name, (c for e in cases for c in e["kernel_goals"] if c["goal"] == name))
              for name, *_ in (*SPEEDUP_GOALS, FLOOR_GOAL)),
            tally(f"eager, <= {HOST_PATH_MAX_TOKENS} tokens: eager_us <= max(1.3 x fp16_cublas eager_us, "
                  "1.1 x graph_us)", (e["host_goal"] for e in cases)),
        ],
        "batch1_speedup_geomean": {mode: geomean(e[f"{mode}_speedup"] for e in batch1 if e[f"{mode}_speedup"])
                                   for mode in ("eager", "graph")},
        "switch_time_ratios": switch,
        "fused_prefill_over_cublas_time": fused,
        "speedup_over_faster_aqlm_kernel": {mode: {"per_case": v, "geomean": geomean(v.values())}
                                            for mode, v in vs_aqlm.items() if v},
    }
