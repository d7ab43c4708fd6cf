#!/usr/bin/env bash
# VQ family on the GPU machine, one call: GPU tests, a sweep of the resident decode schedule
# (scripts/vq_decode_sweep.py; it picks the config the benchmark then runs), then `tilefuse bench
# vq`. Logs and JSON go to $OUT (at most 8 files come back).
#   bash scripts/gpu_vq.sh [tests] [sweep|sweep-quick] [bench|bench-quick]   (default: all three)
set -o pipefail
OUT=${OUT:-/tmp/vq_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
steps="${*:-tests sweep bench}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/log.txt"
for step in $steps; do
  case $step in
    tests) timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider --tb=short \
             tests/test_vq_op.py tests/test_vq_nn.py 2>&1 | tail -40 | cut -c1-300 | tee -a "$OUT/log.txt" ;;
    sweep*) timeout ${SWEEP_TIMEOUT:-200} python3 scripts/vq_decode_sweep.py "$OUT" ${step#sweep-} 2>&1 \
              | tee "$OUT/sweep.txt" | grep -E "PICK|Error|error" | tee -a "$OUT/log.txt"
            [ -s "$OUT/resident_cfg.txt" ] && export TILEFUSE_VQ_RESIDENT_CFG=$(cat "$OUT/resident_cfg.txt") ;;
    bench*) echo "bench resident config: ${TILEFUSE_VQ_RESIDENT_CFG:-default}" | tee -a "$OUT/log.txt"
            quick=$([ "$step" = bench-quick ] && echo --quick)
            timeout ${BENCH_TIMEOUT:-330} python3 -m tilefuse bench vq $quick --rep-ms ${REP_MS:-20} --out "$OUT" 2>&1 \
              | tee "$OUT/bench.txt" | grep -v "^\[vq" | tail -60 ;;
  esac
done
