"""Sweep the launch settings of the VQ resident-table decode kernel on a GPU and pick one.

    python3 tools/vq_decode_sweep.py [OUT_DIR] [--quick] [--configs FILE]
    TILEFUSE_CONFIGS=configs.json tilefuse bench vq          # then measure the pick

For every benchmark shape (``tilefuse/bench/vq.py``; --quick: 4096x4096 and 28672x8192) at 1, 2
and 4 tokens (fp16), each candidate ``(block_r, num_warps, build_rows, ahead)`` of the resident
kernel is timed as CUDA-graph replays (cold L2) of ``tilefuse.vq_matmul`` with the decode variant
forced, each candidate in a fresh process with a ``TILEFUSE_CONFIGS`` file holding it. cuBLAS on
the dequantized weight (and the dequantize + cuBLAS path where the benchmark forces it) is timed
beside, once. An output more than 2e-3 (relative) away from cuBLAS's (both round to fp16: ~2e-4
apart) gets no time, so a wrong config is never picked.

The pick (best geomean time at 1 token) is merged into the ``"vq"`` section of the configs file
(``{"resident": {...}}``); every time goes to ``OUT_DIR/vq-decode-sweep-<gpu>.json`` (default
``bench/results/sweeps/``). Needs a CUDA GPU.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

from sweep_common import (merge_section, parse_args, read_configs, run_with_configs, sweep_path, update_section,
                          write_json)

# (rows per block, warps, code blocks in flight); --quick: the first four
CANDIDATES = [dict(block_r=br, num_warps=nw, build_rows=256, ahead=ahead)
              for br, nw, ahead in [(128, 16, 2), (128, 16, 3), (128, 16, 4), (256, 32, 4), (128, 32, 4),
                                    (64, 16, 4), (256, 32, 2), (256, 16, 2)]]
TOKENS = (1, 2, 4)
MAX_REL_ERR = 2e-3   # two fp16 roundings of the same product: ~2e-4


def shapes(quick: bool) -> list[tuple[int, int]]:
    from tilefuse.bench.vq import SHAPES

    return [SHAPES[0], SHAPES[4]] if quick else SHAPES


def measure(what: str, quick: bool) -> list[dict]:
    """Worker (one process): time "resident" (the decode variant under this process's configs)
    or "baselines" (cuBLAS, dequantize + cuBLAS) on every shape and token count."""
    import torch

    from tilefuse.bench.harness import Timer
    from tilefuse.bench.vq import vq_case

    timer = Timer(torch.device("cuda"), rep_ms=10)
    names = {"resident": ("tilefuse:decode",), "baselines": ("fp16_cublas", "tilefuse:dequant")}[what]
    rows = []
    for (n, k), m in itertools.product(shapes(quick), TOKENS):
        impls = vq_case(n, k, m, torch.float16, torch.device("cuda")).setup()
        ref = impls["fp16_cublas"]().float()
        for name in (n for n in names if n in impls):   # the benchmark forces dequant from 16 tokens only
            err = float((impls[name]().float() - ref).norm() / ref.norm())
            us = timer.graph_us(impls[name]) if err < MAX_REL_ERR else None
            rows.append(dict(N=n, K=k, tokens=m, impl=name, us=us, rel_err=err))
            print(f"{n}x{k} m={m} {name:16s} {us if us is None else round(us, 2)} us  err {err:.1e}",
                  file=sys.stderr, flush=True)
        del impls, ref
    return rows


def main() -> None:
    args = parse_args(__doc__)
    if args.measure:
        print(json.dumps(measure(args.measure, args.quick)))
        return
    quick = ["--quick"] if args.quick else []
    base = read_configs(args.configs)
    baselines = run_with_configs(base, [__file__, "--measure", "baselines", *quick])
    timed = []
    for cfg in CANDIDATES[:4] if args.quick else CANDIDATES:
        print(f"candidate {cfg}", file=sys.stderr, flush=True)
        trial = merge_section(base, "vq", {"resident": cfg})
        rows = run_with_configs(trial, [__file__, "--measure", "resident", *quick])
        timed.append((cfg, rows))

    def score(rows):  # geomean time at 1 token; a config that failed anywhere is out
        times = [r["us"] for r in rows if r["tokens"] == 1]
        return math.exp(sum(map(math.log, times)) / len(times)) if all(times) else math.inf

    cublas = {(r["N"], r["K"], r["tokens"]): r["us"] for r in baselines if r["impl"] == "fp16_cublas"}
    for cfg, rows in timed:
        speedups = [cublas[r["N"], r["K"], 1] / r["us"] for r in rows if r["tokens"] == 1 and r["us"]]
        print(f"{cfg}: geomean {score(rows):.2f} us at 1 token, speedup over cuBLAS "
              + ", ".join(f"{s:.2f}x" for s in speedups))
    pick, pick_rows = min(timed, key=lambda t: score(t[1]))
    if score(pick_rows) == math.inf:
        sys.exit("no candidate ran correctly on every shape: nothing picked")
    print(f"pick: {pick}")
    write_json(sweep_path("vq-decode-sweep", args.out_dir),
               {"candidates": [{"config": cfg, "rows": rows} for cfg, rows in timed], "baselines": baselines,
                "pick": pick}, quick=args.quick)
    update_section(args.configs, "vq", {"resident": pick})
    print(f"merged into {args.configs}: TILEFUSE_CONFIGS={args.configs} tilefuse bench vq")


if __name__ == "__main__":
    main()
