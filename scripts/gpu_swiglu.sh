#!/usr/bin/env bash
# The SwiGLU family's GPU session in one call (run from the repo root on the H200):
#   bash scripts/gpu_swiglu.sh tune    # GPU tests + full config sweep (scripts/tune_swiglu.py)
#   bash scripts/gpu_swiglu.sh bench   # dispatch/nn/hf GPU tests + `tilefuse bench swiglu`
#   bash scripts/gpu_swiglu.sh tiles   # the same with the second sweep (data-parallel tile shapes)
#   bash scripts/gpu_swiglu.sh tail    # GPU tests + tail-wave sweep (stream-K, CUDA-graph timed), then
#                                      # `tilefuse bench swiglu` on the cases whose config changed,
#                                      # run with the sweep's winners (TILEFUSE_SWIGLU_CONFIGS)
# Logs and JSON go to $OUT (default /tmp/swiglu-out).
set -o pipefail
MODE=${1:-bench}
OUT=${OUT:-/tmp/swiglu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TESTS="tests/test_swiglu_gpu.py tests/test_swiglu_nn.py tests/test_hf.py"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  python3 -m tilefuse info 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "$MODE" = tune ]; then
    timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=line $TESTS > "$OUT/pytest.txt" 2>&1
    grep -E "^(/|E |FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | cut -c1-220 | tail -60
    timeout 260 python3 scripts/tune_swiglu.py "$OUT"
  elif [ "$MODE" = tail ] || [ "$MODE" = tiles ]; then
    timeout ${T_TESTS:-100} python3 -m pytest -q -n 8 -p no:cacheprovider --tb=line $TESTS > "$OUT/pytest.txt" 2>&1
    grep -E "^(/|E |FAILED|ERROR)|passed|failed|xfail" "$OUT/pytest.txt" | cut -c1-220 | tail -40
    timeout ${T_SWEEP:-120} python3 scripts/tune_swiglu.py "$MODE" "$OUT"
    CHANGED=$(tr -d '\n' < "$OUT/changed.txt" 2>/dev/null)
    echo "changed: $CHANGED"
    if [ -n "$CHANGED" ]; then
      TILEFUSE_SWIGLU_CONFIGS="$OUT/swiglu-tail-configs.json" TILEFUSE_BENCH_SWIGLU_CASES="$CHANGED" \
        timeout ${T_BENCH:-100} python3 -m tilefuse bench swiglu --out "$OUT/bench" --rep-ms 20 2>&1 | grep -v '^\[swiglu'
    fi
  else
    timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider --tb=line $TESTS > "$OUT/pytest.txt" 2>&1
    grep -E "^(/|E |FAILED|ERROR)|passed|failed" "$OUT/pytest.txt" | cut -c1-220 | tail -60
    timeout 330 python3 -m tilefuse bench swiglu --out "$OUT" --rep-ms 25
  fi
} 2>&1 | tee "$OUT/log.txt"
