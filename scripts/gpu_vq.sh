#!/usr/bin/env bash
# VQ family on the GPU machine, one call: GPU tests, then (mode "sweep") a config sweep of the
# decode/prefill kernels or (mode "bench") the full `tilefuse bench vq`. Logs and JSON go to $OUT.
#   bash scripts/gpu_vq.sh sweep|bench
set -o pipefail
MODE=${1:-bench}
OUT=${OUT:-/tmp/vq_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/log.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m gpu tests/test_vq_op.py tests/test_vq_nn.py 2>&1 \
  | tail -25 | tee -a "$OUT/log.txt"
if [ "$MODE" = sweep ]; then
timeout ${SWEEP_TIMEOUT:-200} python3 - <<'PY' 2>&1 | tee "$OUT/sweep.txt"
import torch, triton
from tilefuse.bench.harness import Timer
from tilefuse.ops.vq import op
from tilefuse.testing.vq import make_vq_case
timer = Timer(torch.device("cuda"), rep_ms=25)
def run(fn):
    try:
        return f"{timer.graph_us(fn):8.2f}"
    except Exception as e:
        return "ERR " + str(e)[:80]
for (n, k, m) in [(4096, 4096, 1), (28672, 8192, 1), (4096, 4096, 8)]:
    if True:
        c = make_vq_case(m, n, k, torch.float16, "cuda")
        args = (c["x"], c["codes"], c["codebooks"], c["scales"].reshape(n), None)
        out = torch.empty(m, n, dtype=torch.float16, device="cuda")
        auto = op.decode_config(m, n, k, torch.device("cuda"))["split_k"]
        for bn, w in [(64, 4), (128, 4), (128, 8), (256, 8)]:
            res = []
            for sk in sorted({auto, auto * 2}):
                res.append(f"sk={sk}:" + run(lambda: op.launch_decode(*args, out, block_n=bn, num_warps=w, split_k=sk)))
            print(f"decode {n}x{k} m={m} bn={bn} w={w}", *res, flush=True)
        w16 = c["x"].new_empty(n, k).normal_()
        print(f"cublas {n}x{k} m={m}", run(lambda: torch.nn.functional.linear(c["x"], w16)), flush=True)
for (n, k) in [(8192, 8192)]:
    for m in (64, 512):
        c = make_vq_case(m, n, k, torch.bfloat16, "cuda")
        args = (c["x"], c["codes"], c["codebooks"], c["scales"].reshape(n), None)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        for cfg in [dict(block_m=min(128, max(16, m)), block_n=128, block_k=64, num_warps=4, num_stages=3),
                    dict(block_m=min(128, max(16, m)), block_n=128, block_k=64, num_warps=8, num_stages=3),
                    dict(block_m=min(128, max(16, m)), block_n=256, block_k=64, num_warps=8, num_stages=3),
                    dict(block_m=min(64, max(16, m)), block_n=128, block_k=64, num_warps=4, num_stages=4)]:
            t = timer.median_us(lambda: op.launch_prefill(*args, out, **cfg))
            print(f"prefill {n}x{k} m={m} {cfg} {t:8.2f}", flush=True)
        w16 = c["x"].new_empty(n, k).normal_()
        print(f"cublas {n}x{k} m={m} {timer.median_us(lambda: torch.nn.functional.linear(c['x'], w16)):8.2f}", flush=True)
PY
else
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/diag.txt"
# decode diagnostics: Gluon kernel present? table conversion on/off, split-K on/off (graph replay us)
import torch
from tilefuse.bench.harness import Timer
from tilefuse.ops.vq import op
from tilefuse.testing.vq import make_vq_case
print("gluon kernel:", op._gluon_decode() is not None, op.kernel_status(torch.device("cuda")))
timer = Timer(torch.device("cuda"), rep_ms=20)
for n, k in [(4096, 4096), (28672, 8192)]:
    c = make_vq_case(1, n, k, torch.float16, "cuda")
    args = (c["x"], c["codes"], c["codebooks"], c["scales"].reshape(n), None)
    out = torch.empty(1, n, dtype=torch.float16, device="cuda")
    for kw in [dict(), dict(convert_table=False), dict(split_k=1), dict(impl="tl")]:
        print(n, k, kw, f"{timer.graph_us(lambda: op.launch_decode(*args, out, **kw)):.2f}", flush=True)
PY
timeout ${BENCH_TIMEOUT:-400} python3 -m tilefuse bench vq --rep-ms ${REP_MS:-25} --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | grep -v "^\[vq"
fi
if [ "$MODE" = bench ] && command -v ncu >/dev/null; then
# one profile of each kernel (decode 4096x4096 batch 1, prefill 8192x8192 x 512): where the time goes
timeout ${NCU_TIMEOUT:-120} ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats -k regex:vq_ -c 2 python3 -c "
import torch, tilefuse
from tilefuse.testing.vq import make_vq_case
for m, n, k in [(1, 4096, 4096), (512, 8192, 8192)]:
    c = make_vq_case(m, n, k, torch.float16, 'cuda')
    tilefuse.vq_matmul(c['x'], c['codes'], c['codebooks'], c['scales']); torch.cuda.synchronize()
" > "$OUT/ncu.txt" 2>&1; tail -5 "$OUT/ncu.txt"
fi
