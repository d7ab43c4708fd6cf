"""Sweep the MMA decode kernel's launch settings and the VQ switch points on a GPU.

    python3 tools/vq_mma_sweep.py [OUT_DIR] [--quick] [--configs FILE]

For every benchmark shape (``tilefuse/bench/vq.py``; --quick: 4096x4096 and 28672x8192) at 2, 8 and
16 tokens (fp16), each candidate ``configs.MMA`` setting of ``kernels_mma.vq_decode_mma_kernel``
is timed as CUDA-graph replays (cold L2) through ``op.launch_mma`` (one process; the per-shape
split is recomputed for each). Beside it, once per case:
fp16 cuBLAS on the dequantized weight, the table decode (2-4 tokens) and dequantize + cuBLAS (16
tokens). An output more than 2e-3 (relative) away from cuBLAS's gets no time, so a wrong config is
never picked. Every time goes to ``OUT_DIR/vq-mma-sweep-<gpu>.json`` (default
``bench/results/sweeps/``) with the pick (best geomean time over all cases) and the per-token
geomean speedups over cuBLAS; the pick is merged into the ``"vq"`` section of the configs file
(``{"mma": {...}}``). Needs a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math

from sweep_common import GraphRecorder, parse_args, sweep_path, update_section

CANDIDATES = [dict(block_n=bn, krep=kr, num_warps=nw, ctas_per_sm=c, fixed_steps=4)
              for bn, kr, nw, c in [(128, 4, 4, 3), (256, 4, 4, 2), (256, 2, 4, 2), (128, 4, 8, 3), (128, 2, 4, 3)]]
TOKENS = (2, 4, 8, 16)
MAX_REL_ERR = 2e-3


@contextlib.contextmanager
def _mma_settings(cfg):
    """The MMA kernel's measured settings replaced by ``cfg`` (the per-shape choice recomputed)."""
    from tilefuse.ops.vq import configs

    saved = dict(configs.MMA)
    configs.MMA.update(cfg)
    configs.mma_config.cache_clear()
    try:
        yield
    finally:
        configs.MMA.update(saved)
        configs.mma_config.cache_clear()


def main() -> None:
    args = parse_args(__doc__, workers=False, **{"--quick": dict(action="store_true", help="fewer shapes")})

    import torch
    import torch.nn.functional as F

    import tilefuse
    from tilefuse.bench.runner import machine_info
    from tilefuse.bench.vq import BENCH_SHAPES
    from tilefuse.ops.vq import op as vq_op
    from tilefuse.ops.vq.reference import dequantize
    from tilefuse.testing.vq import make_case

    shapes = [BENCH_SHAPES[0], BENCH_SHAPES[4]] if args.quick else BENCH_SHAPES
    record = GraphRecorder(MAX_REL_ERR)
    rows = record.rows

    for (n, k), m in itertools.product(shapes, TOKENS):
        c = make_case(m, n, k, torch.float16, "cuda")
        w = dequantize(c.codes, c.codebooks, c.scales, dtype=torch.float16)
        ref = F.linear(c.x, w).float()
        record(n, k, m, "fp16_cublas", lambda: F.linear(c.x, w), ref)
        for variant in (["decode"] if m <= 4 else []) + (["dequant"] if m >= 8 else []):
            def forced(variant=variant):
                with tilefuse.force(variant=variant):
                    return tilefuse.vq_matmul(c.x, c.codes, c.codebooks, c.scales)
            record(n, k, m, variant, forced, ref)
        out = torch.empty(m, n, dtype=torch.float16, device="cuda")
        for cfg in CANDIDATES:
            with _mma_settings(cfg):
                record(n, k, m, "mma", lambda: vq_op.launch_mma(c.x, c.codes, c.codebooks, c.scales.reshape(n), None,
                                                                out, impl="gluon"), ref, config=cfg)

    def score(cfg):
        times = [r["us"] for r in rows if r.get("config") == cfg]
        return math.exp(sum(map(math.log, times)) / len(times)) if times and all(times) else math.inf

    pick = min(CANDIDATES, key=score)
    cublas = {(r["N"], r["K"], r["tokens"]): r["us"] for r in rows if r["impl"] == "fp16_cublas"}
    speedups = {}
    for m in TOKENS:
        s = [cublas[r["N"], r["K"], m] / r["us"] for r in rows
             if r.get("config") == pick and r["tokens"] == m and r["us"] and cublas.get((r["N"], r["K"], m))]
        speedups[m] = round(math.exp(sum(map(math.log, s)) / len(s)), 3) if s else None
    print(f"pick: {pick}, geomean speedup over cuBLAS by tokens {speedups}")
    out = sweep_path("vq-mma-sweep", args.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(torch.device("cuda")), "quick": args.quick,
                               "candidates": CANDIDATES, "rows": rows, "pick": pick,
                               "pick_speedup_geomean": speedups}, indent=1))
    update_section(args.configs, "vq", {"mma": pick})
    print(f"wrote {out}; TILEFUSE_CONFIGS={args.configs} tilefuse bench vq  # measures the pick")


if __name__ == "__main__":
    main()
