"""Sweep the resident-table decode schedule on the GPU (graph replay, cold L2) and pick one.

    python3 scripts/vq_decode_sweep.py OUT_DIR [quick]

For every bench shape at 1, 2 and 4 tokens: each (block_r, num_warps, build_rows) config of the
resident kernel, the gl.gather kernel, cuBLAS on the dequantized weight and (2, 4 tokens) the dequant path, with a relative-error
check against an fp32 product (a config that is wrong is reported and never picked). Writes
OUT_DIR/vq_sweep.json and OUT_DIR/resident_cfg.txt (the config with the best geomean at 1 token).
"""

import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from tilefuse.bench.harness import Timer
from tilefuse.ops.vq import op
from tilefuse.ops.vq.reference import dequantize
from tilefuse.testing.vq import make_vq_case

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (28672, 8192), (8192, 28672)]
CONFIGS = [dict(block_r=br, num_warps=nw, build_rows=256)
           for br, nw in [(128, 32), (256, 32), (64, 32), (128, 16), (256, 16)]]
TOKENS = {1: CONFIGS, 2: CONFIGS, 4: CONFIGS[:2]}


def cfg_env(cfg):
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def main(out_dir, quick=False):
    timer = Timer(torch.device("cuda"), rep_ms=10)
    configs = CONFIGS[:4] if quick else CONFIGS
    rows, times = [], {}
    for (n, k), m in itertools.product(SHAPES, TOKENS):
        c = make_vq_case(m, n, k, torch.float16, "cuda")
        args = (c["x"], c["codes"], c["codebooks"], c["scales"].reshape(n), None)
        w = dequantize(c["codes"], c["codebooks"], c["scales"], dtype=torch.float16)
        ref = c["x"].float() @ w.float().T
        out = torch.empty(m, n, dtype=torch.float16, device="cuda")

        def timed(name, fn, cfg=None):
            out.fill_(float("nan"))
            fn()
            err = float((out.float() - ref).norm() / ref.norm())  # fp16 output rounding: ~2e-4
            us = timer.graph_us(fn) if err < 2e-3 else float("inf")
            rows.append(dict(N=n, K=k, tokens=m, impl=name, cfg=cfg, us=round(us, 2), rel_err=err))
            print(f"{n}x{k} m={m} {name:9s} {cfg_env(cfg) if cfg else '':40s} {us:8.2f} us  err {err:.1e}", flush=True)
            return us

        timed("cublas", lambda: torch.mm(c["x"], w.T, out=out))
        timed("gather", lambda: op.launch_decode(*args, out, impl="gather"))
        if m > 1:
            timed("dequant", lambda: op.launch_dequant(*args, out))
        for i, cfg in enumerate(configs if m == 1 else TOKENS[m][:len(configs)]):
            os.environ["TILEFUSE_VQ_RESIDENT_CFG"] = cfg_env(cfg)
            times.setdefault(i, {})[(n, k, m)] = timed("resident", lambda: op.launch_decode(*args, out, impl="resident"), cfg)
        os.environ.pop("TILEFUSE_VQ_RESIDENT_CFG")
        del c, w, ref
    score = {i: sum(math.log(t) for (n, k, m), t in ts.items() if m == 1) for i, ts in times.items()}
    best = min(score, key=score.get)
    print("PICK", cfg_env(configs[best]))
    with open(os.path.join(out_dir, "vq_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows,
                       pick=configs[best]), f, indent=1)
    with open(os.path.join(out_dir, "resident_cfg.txt"), "w") as f:
        f.write(cfg_env(configs[best]))


if __name__ == "__main__":
    main(sys.argv[1], quick="quick" in sys.argv[2:])
