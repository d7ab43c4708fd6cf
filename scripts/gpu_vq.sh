#!/usr/bin/env bash
# VQ family on the GPU machine, one call: GPU tests, a sweep of the decode schedule (which picks
# the config the benchmark runs), then the full `tilefuse bench vq`. Logs and JSON go to $OUT.
#   bash scripts/gpu_vq.sh [bench]      (NCU=1 adds one Nsight Compute profile per kernel)
set -o pipefail
MODE=${1:-bench}
OUT=${OUT:-/tmp/vq_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/log.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m gpu tests/test_vq_op.py tests/test_vq_nn.py 2>&1 \
  | tail -25 | tee -a "$OUT/log.txt"
if [ "$MODE" = bench ]; then
# decode schedule sweep (graph replay us), picks the config the bench then runs (printed + saved)
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/diag.txt"
import itertools, json, math, os, torch
from tilefuse.bench.harness import Timer
from tilefuse.ops.vq import op
from tilefuse.testing.vq import make_vq_case
print("gluon kernel:", op._gluon_decode() is not None, op.kernel_status(torch.device("cuda")))
timer = Timer(torch.device("cuda"), rep_ms=15)
shapes = [(1, 4096, 4096), (1, 28672, 8192), (8, 8192, 8192)]
cfgs = [dict(block_n=bn, num_warps=8, convert_table=cv, split_mult=sm)
        for bn, cv, sm in itertools.product((128, 256), (1, 0), (2,))]
from tilefuse.ops.vq.reference import dequantize
res = {}
for m, n, k in shapes:
    c = make_vq_case(m, n, k, torch.float16, "cuda")
    args = (c["x"], c["codes"], c["codebooks"], c["scales"].reshape(n), None)
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    ref = c["x"].float() @ dequantize(c["codes"], c["codebooks"], c["scales"], dtype=torch.float32).T
    for i, cfg in enumerate(cfgs):
        os.environ["TILEFUSE_VQ_DECODE_CFG"] = ",".join(f"{a}={b}" for a, b in cfg.items())
        out.fill_(float("nan"))
        op.launch_decode(*args, out)
        err = float((out.float() - ref).norm() / ref.norm())  # fp16 output rounding: ~2e-4
        t = timer.graph_us(lambda: op.launch_decode(*args, out)) if err < 2e-3 else float("inf")
        res.setdefault(i, []).append(t)
        print(m, n, k, cfg, f"{t:.2f} us  rel_err {err:.2e}", flush=True)
best = min(res, key=lambda i: sum(math.log(t) for t in res[i]))
pick = ",".join(f"{a}={b}" for a, b in cfgs[best].items())
print("PICK", pick, [round(t, 2) for t in res[best]])
open(os.environ["OUT"] + "/decode_cfg.txt", "w").write(pick)
PY
export TILEFUSE_VQ_DECODE_CFG=$(cat "$OUT/decode_cfg.txt" 2>/dev/null)
echo "bench decode config: $TILEFUSE_VQ_DECODE_CFG" | tee -a "$OUT/log.txt"
timeout ${BENCH_TIMEOUT:-400} python3 -m tilefuse bench vq --rep-ms ${REP_MS:-25} --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | grep -v "^\[vq"
fi
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
# one profile of each kernel (decode 4096x4096 batch 1, prefill 8192x8192 x 512): where the time goes
timeout ${NCU_TIMEOUT:-120} ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables -k regex:vq_ -c 2 python3 -c "
import torch, tilefuse
from tilefuse.testing.vq import make_vq_case
for m, n, k in [(1, 4096, 4096), (512, 8192, 8192)]:
    c = make_vq_case(m, n, k, torch.float16, 'cuda')
    tilefuse.vq_matmul(c['x'], c['codes'], c['codebooks'], c['scales']); torch.cuda.synchronize()
" > "$OUT/ncu.txt" 2>&1; tail -5 "$OUT/ncu.txt"
fi
