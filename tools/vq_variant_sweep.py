"""Every VQ kernel variant, and the dense baselines, on a log-spaced spread of the shape corpus's
linear layers at 1-512 tokens: what the VQ dispatch's cost model is calibrated on.

    python3 tools/vq_variant_sweep.py [OUT_DIR] [--quick]   # -> OUT_DIR/vq-variants-<gpu>.json

Shapes: the corpus's linear (N, K) of the models that are not held out (``corpus.HELD_OUT`` is
kept for checking the fit), those with N x K <= 2^29 sorted by N x K and picked evenly in log(N x K) (16; 6 with --quick).
Per shape and token count, fp16, random codes, CUDA-graph replay (cold L2): ``decode`` (the
table decode), ``mma`` (the MMA decode), ``prefill`` (the WGMMA prefill where K % 64 == 0),
``dequant`` (dequantize into a scratch weight, then cuBLAS) and ``fp16_dense`` (cuBLAS on the
dense weight: what a user without 2-bit weights had). Each output is checked against the dense
GEMM first (relative error < 2e-3, else no time). Needs a CUDA GPU.
"""

from __future__ import annotations

import math

from sweep_common import GraphRecorder, parse_args, sweep_path, write_json

TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def calibration_shapes(count: int) -> list[tuple[int, int]]:
    from tilefuse.testing import corpus

    dims = sorted({s.dims for s in corpus.shapes("linear", held_out=False) if s.dims[0] * s.dims[1] <= 2 ** 29},
                  key=lambda d: (d[0] * d[1], d))
    lo, hi = math.log(dims[0][0] * dims[0][1]), math.log(dims[-1][0] * dims[-1][1])
    picked = []
    for j in range(count):
        target = lo + (hi - lo) * j / (count - 1)
        best = min((d for d in dims if d not in picked), key=lambda d: abs(math.log(d[0] * d[1]) - target))
        picked.append(best)
    return sorted(picked, key=lambda d: d[0] * d[1])


def main() -> None:
    args = parse_args(__doc__, configs=False, workers=False,
                      **{"--quick": dict(action="store_true", help="6 shapes, fewer token counts")})
    import torch

    from tilefuse.ops.vq import op as vq_op
    from tilefuse.ops.vq.reference import dequantize
    from tilefuse.testing.vq import make_case

    torch.manual_seed(0)
    record = GraphRecorder(rep_ms=10)
    tokens = (1, 4, 16, 64, 256, 512) if args.quick else TOKENS
    for n, k in calibration_shapes(6 if args.quick else 16):
        for m in tokens:
            case = make_case(m, n, k, torch.float16, "cuda")
            flat = case.scales.reshape(n)
            w = dequantize(case.codes, case.codebooks, case.scales, dtype=torch.float16)
            ref = torch.nn.functional.linear(case.x, w).float()
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            vq_args = (case.x, case.codes, case.codebooks, flat, None)
            runs = {"fp16_dense": lambda: torch.nn.functional.linear(case.x, w),
                    "mma": lambda: vq_op.launch_mma(*vq_args, out, impl="auto"),
                    "dequant": lambda: vq_op.launch_dequant(*vq_args, out)}
            if m <= 8:      # the table decode's range
                runs["decode"] = lambda: vq_op.launch_decode(*vq_args, out, impl="auto")
            if k % 64 == 0:
                runs["prefill"] = lambda: vq_op.launch_prefill(*vq_args, out, impl="auto")
            for impl, fn in runs.items():
                record(n, k, m, impl, fn, ref)
            del case, w
    write_json(sweep_path("vq-variants", args.out_dir), record.rows, quick=args.quick, tokens=list(tokens))


if __name__ == "__main__":
    main()
