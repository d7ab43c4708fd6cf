"""``tilefuse bench vq``: 2-bit VQ linear (AQLM 2x8) against fp16/bf16 cuBLAS on the dequantized weight.

Codes, codebooks and scales are random (timing does not depend on their values). Impls:
``tilefuse`` (default dispatch), ``tilefuse:decode`` (1-8 tokens), ``tilefuse:dequant`` (all token
counts: dequantize + cuBLAS, to locate the switch point), ``tilefuse:prefill`` (the fused
dequant-in-registers GEMM; 16 and 512 tokens only, it is slow), ``fp16_cublas`` (``F.linear`` on
the dequantized weight in the case's dtype; the name follows the issue, the dtype is the case's). Decode-sized cases are also
timed as CUDA-graph replays. ``bytes`` counts codes + x + out + scales (+ codebooks); the memory
floor of the summary is code bytes / measured copy bandwidth.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from tilefuse.bench.harness import Case, best_us, geomean

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (28672, 8192), (8192, 28672)]
TOKENS = [1, 2, 4, 8, 16, 64, 512]
DTYPES = [torch.float16, torch.bfloat16]
# AQLM CUDA 2x8 kernel, batch 1, fp16, measured on this H200 earlier (../shared/anchors.md), NOT this run
AQLM_2X8_ANCHOR_US = {"4096x4096": 90.2, "11008x4096": 148.4, "4096x11008": 73.0, "8192x8192": 120.6,
                      "28672x8192": 130.7}
FP16_CUBLAS_ANCHOR_US = {"4096x4096": 19.1, "11008x4096": 33.6, "4096x11008": 36.4, "8192x8192": 48.4,
                         "28672x8192": 122.2}


def _case(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device) -> Case:
    def setup():
        import tilefuse
        from tilefuse.ops.vq.reference import dequantize
        from tilefuse.testing.vq import make_vq_case

        c = make_vq_case(m, n, k, dtype, device)
        args = (c["x"], c["codes"], c["codebooks"], c["scales"])
        w = dequantize(c["codes"], c["codebooks"], c["scales"], dtype=dtype)

        def forced(variant):
            def run():
                with tilefuse.force(variant=variant):
                    return tilefuse.vq_matmul(*args)
            return run

        impls = {"tilefuse": lambda: tilefuse.vq_matmul(*args)}
        if device.type == "cuda":
            if m <= 8:
                impls["tilefuse:decode"] = forced("decode")
            impls["tilefuse:dequant"] = forced("dequant")
            if m in (16, 512):
                impls["tilefuse:prefill"] = forced("prefill")
        impls["fp16_cublas"] = lambda: F.linear(c["x"], w)
        return impls

    size = 2 if dtype != torch.float32 else 4
    nbytes = n * k / 4 + (m * k + m * n) * size + n * size + 2 * 256 * 8 * size
    params = {"N": n, "K": k, "tokens": m, "dtype": str(dtype).replace("torch.", "")}
    return Case(params=params, flops=2.0 * m * n * k, bytes=nbytes, setup=setup, graph=m <= 16)


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type != "cuda":  # pipeline check on the CPU: reference path, tiny shapes
        return [_case(n, k, m, torch.float16, device) for n, k in [(64, 128), (96, 256)] for m in (1, 8, 32)]
    shapes = SHAPES[:1] + SHAPES[4:5] if quick else SHAPES
    tokens = [1, 8, 512] if quick else TOKENS
    return [_case(n, k, m, dt, device) for dt in DTYPES for n, k in shapes for m in tokens]


def summarize(rows: list[dict]) -> dict:
    """Targets of issue 5: speedups over cuBLAS / AQLM anchors, prefill ratio, switch points."""
    table: dict = {}
    for r in rows:
        p = r["params"]
        key = (f"{p['N']}x{p['K']}", p["tokens"], p["dtype"])
        table.setdefault(key, {})[r["impl"]] = r
    out: dict = {"note": "times are min(eager median, CUDA-graph replay median), cold L2; "
                         "AQLM figures are anchors from ../shared/anchors.md (earlier run), not this run"}
    checks = []

    def ratio(shape, tokens, dtype, num, den):
        rs = table.get((shape, tokens, dtype), {})
        a, b = rs.get(num), rs.get(den)
        if not a or not b or not best_us(a) or not best_us(b):
            return None
        return best_us(a) / best_us(b)

    def check(name, value, target, higher=True):
        ok = None if value is None else (value >= target if higher else value <= target)
        checks.append({"target": name, "measured": None if value is None else round(value, 3),
                       "goal": (">= " if higher else "<= ") + str(target), "met": ok})

    for dtype in ("float16", "bfloat16"):
        check(f"batch1 28672x8192 {dtype}: fp16_cublas / tilefuse", ratio("28672x8192", 1, dtype, "fp16_cublas", "tilefuse"), 5.0)
        check(f"batch1 4096x4096 {dtype}: fp16_cublas / tilefuse", ratio("4096x4096", 1, dtype, "fp16_cublas", "tilefuse"), 3.0)
        for shape in ("4096x4096", "11008x4096", "4096x11008", "8192x8192", "28672x8192", "8192x28672"):
            check(f"8 tokens {shape} {dtype}: fp16_cublas / tilefuse", ratio(shape, 8, dtype, "fp16_cublas", "tilefuse"), 2.0)
            if dtype == "bfloat16":
                check(f"512 tokens {shape} bf16: tilefuse / cublas", ratio(shape, 512, dtype, "tilefuse", "fp16_cublas"), 1.3, higher=False)
    for shape, anchor in AQLM_2X8_ANCHOR_US.items():
        ours = table.get((shape, 1, "float16"), {}).get("tilefuse")
        if ours and best_us(ours):
            goal = 10.0 if shape in ("4096x4096", "11008x4096", "4096x11008", "8192x8192") else 5.0
            check(f"batch1 {shape} fp16: AQLM 2x8 anchor {anchor} us / tilefuse", anchor / best_us(ours), goal)
    from tilefuse.ops.vq.op import DECODE_TUNED, RESIDENT_TUNED, _tuned_env

    out["decode_config"] = {"resident": _tuned_env("TILEFUSE_VQ_RESIDENT_CFG", RESIDENT_TUNED),
                            "gather": _tuned_env("TILEFUSE_VQ_DECODE_CFG", DECODE_TUNED)}
    out["targets"] = checks
    out["targets_met"] = sum(1 for c in checks if c["met"]), sum(1 for c in checks if c["met"] is not None)

    # batch-1 detail: time, roofline (memory floor) and fraction of it
    detail = {}
    for (shape, tokens, dtype), rs in sorted(table.items()):
        if tokens == 1 and "tilefuse" in rs and best_us(rs["tilefuse"]):
            r = rs["tilefuse"]
            floor = (r.get("roofline_frac") or 0) * best_us(r)
            detail[f"{shape} {dtype}"] = {"tilefuse_us": round(best_us(r), 2), "floor_us": round(floor, 2),
                                          "fp16_cublas_us": round(best_us(rs["fp16_cublas"]), 2) if "fp16_cublas" in rs else None}
    out["batch1"] = detail
    # switch point: decode time / dequant+cuBLAS time per token count (> 1: dequant path wins)
    switch = {}
    for (shape, tokens, dtype), rs in sorted(table.items(), key=lambda kv: kv[0][1]):
        d, p = rs.get("tilefuse:decode"), rs.get("tilefuse:dequant")
        if d and p and best_us(d) and best_us(p):
            key = f"{shape} {dtype}"
            switch.setdefault(key, {})[tokens] = round(best_us(d) / best_us(p), 3)
    out["decode_over_dequant_time"] = switch
    fused = {}
    for (shape, tokens, dtype), rs in sorted(table.items()):
        f, c = rs.get("tilefuse:prefill"), rs.get("fp16_cublas")
        if f and c and best_us(f) and best_us(c):
            fused[f"{shape} {tokens} {dtype}"] = round(best_us(f) / best_us(c), 2)
    out["fused_prefill_over_cublas_time"] = fused
    geo = [ratio(s, 1, dt, "fp16_cublas", "tilefuse") for s, _, dt in {(k[0], 0, k[2]) for k in table}]
    geo = [g for g in geo if g]
    if geo:
        out["batch1_speedup_geomean"] = round(geomean(geo), 3)
    return out
