"""Sweep the WGMMA prefill kernel's tiles and the VQ prefill switch points on a Hopper GPU.

    python3 tools/vq_prefill_sweep.py [OUT_DIR] [--quick]

For every benchmark shape (``tilefuse/bench/vq.py``; --quick: 4096x4096, 28672x8192 and
4096x14336) at 32, 64, 128 and 512 tokens (fp16), each candidate tile of
``kernels_prefill`` (tokens per tile x warps x ring depth, one-partition or warp-specialized) is
timed as CUDA-graph replays (cold L2) through ``op.launch_prefill``, and beside it the
tile ``configs.wgmma_prefill_config`` picks (``auto``), fp16 cuBLAS on the dequantized weight,
dequantize + cuBLAS and (up to 64 tokens) the MMA decode kernel. An output more than 2e-3
(relative) away from cuBLAS's gets no time. Every time goes to
``OUT_DIR/vq-prefill-sweep-<gpu>.json`` (default ``bench/results/sweeps/``) with, per case, the
fastest tile, the auto pick's loss against it, and the prefill kernel's time over cuBLAS's, over
dequant + cuBLAS's and over the MMA decode's (the switch points). Needs an sm_90 GPU.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

from sweep_common import GraphRecorder, parse_args, sweep_path

CANDIDATES = [dict(block_m=bm, num_warps=nw, stages=st, ws=ws)
              for bm, nw, st, ws in [(64, 4, 6, 0), (64, 8, 6, 0), (128, 4, 4, 0), (128, 8, 6, 0), (256, 8, 4, 0),
                                     (64, 8, 6, 1), (128, 8, 6, 1), (256, 8, 4, 1)]]
TOKENS = (32, 64, 128, 512)
MAX_REL_ERR = 2e-3


def main() -> None:
    args = parse_args(__doc__, workers=False, configs=False, min_capability=(9, 0),
                      **{"--quick": dict(action="store_true", help="fewer shapes")})

    import torch
    import torch.nn.functional as F

    import tilefuse
    from tilefuse.bench.runner import machine_info
    from tilefuse.bench.vq import BENCH_SHAPES
    from tilefuse.ops.vq import configs
    from tilefuse.ops.vq import op as vq_op
    from tilefuse.ops.vq.reference import dequantize
    from tilefuse.testing.vq import make_case

    shapes = [BENCH_SHAPES[0], BENCH_SHAPES[4], BENCH_SHAPES[6]] if args.quick else BENCH_SHAPES
    record = GraphRecorder(MAX_REL_ERR)
    rows = record.rows

    cases = []
    for (n, k), m in itertools.product(shapes, TOKENS):
        c = make_case(m, n, k, torch.float16, "cuda")
        w = dequantize(c.codes, c.codebooks, c.scales, dtype=torch.float16)
        ref = F.linear(c.x, w).float()
        t = {"fp16_cublas": record(n, k, m, "fp16_cublas", lambda: F.linear(c.x, w), ref)}
        for variant in ["dequant"] + (["mma"] if m <= 64 else []):
            def forced(variant=variant):
                with tilefuse.force(variant=variant):
                    return tilefuse.vq_matmul(c.x, c.codes, c.codebooks, c.scales)
            t[variant] = record(n, k, m, variant, forced, ref)
        out = torch.empty(m, n, dtype=torch.float16, device="cuda")
        scales = c.scales.reshape(n)
        auto = configs.wgmma_prefill_config(m, n, k, vq_op.num_sms(c.x.device))
        t["auto"] = record(n, k, m, "prefill", lambda: vq_op.launch_prefill(c.x, c.codes, c.codebooks, scales, None,
                                                                            out, impl="wgmma"), ref, config="auto",
                           picked={key: auto[key] for key in ("block_m", "num_warps", "stages")})
        tiles = {}
        for cfg in CANDIDATES:
            tiles[json.dumps(cfg)] = record(n, k, m, "prefill", lambda: vq_op.launch_prefill(
                c.x, c.codes, c.codebooks, scales, None, out, impl="wgmma", **cfg), ref, config=cfg)
        timed = {key: us for key, us in tiles.items() if us}
        best = min(timed, key=timed.get) if timed else None
        entry = dict(N=n, K=k, tokens=m, best=best and json.loads(best), best_us=best and timed[best],
                     auto_us=t["auto"], auto_over_best=t["auto"] and best and round(t["auto"] / timed[best], 3))
        for other in ("fp16_cublas", "dequant", "mma"):
            if t.get(other) and t["auto"]:
                entry[f"prefill_over_{other}"] = round(t["auto"] / t[other], 3)
        cases.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)

    def geo(values):
        values = [v for v in values if v]
        return round(math.exp(sum(map(math.log, values)) / len(values)), 3) if values else None

    summary = {f"{key} at {m} tokens": geo(e.get(key) for e in cases if e["tokens"] == m)
               for key in ("prefill_over_fp16_cublas", "prefill_over_dequant", "prefill_over_mma", "auto_over_best")
               for m in TOKENS}
    print(json.dumps(summary, indent=1))
    out = sweep_path("vq-prefill-sweep", args.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(torch.device("cuda")), "quick": args.quick,
                               "candidates": CANDIDATES, "summary": summary, "cases": cases, "rows": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
