#!/usr/bin/env bash
# One device call for the MLA family: GPU tests, a launch-config sweep, the benchmark.
#   scripts/gpu_mla.sh [tests] [sweep] [bench] [quick] [h16]     (default: tests bench)
# h16: the bench's 16-head, s_q = 1 cases only (the ones the <= 16-row dispatch changes); sq2: 16 heads, s_q = 2 only.
# "sweep" writes the best config per variant to $OUT/mla_best.json and the benchmark that follows
# runs with it (TILEFUSE_MLA_CONFIGS); op.CONFIGS is then set to the same values by hand.
# Logs and JSON go to $OUT (the device tool brings them back).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mla_out}; mkdir -p "$OUT"
steps="${*:-tests bench}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/log.txt"
for step in $steps; do
  case $step in
    tests) timeout 80 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_mla_gpu.py 2>&1 | tail -30 | tee -a "$OUT/log.txt" ;;
    sweep) timeout 85 python3 -m tilefuse.bench.mla --sweep "$OUT/mla_best.json" 2>&1 | tee "$OUT/sweep.txt"
           [ -s "$OUT/mla_best.json" ] && export TILEFUSE_MLA_CONFIGS="$OUT/mla_best.json" ;;
    bench) timeout 250 python3 -m tilefuse bench mla --out "$OUT" --rep-ms 20 2>&1 | tee "$OUT/bench.txt" | grep -v '^\[mla' | tail -160 ;;
    h16) timeout 95 python3 -m tilefuse bench mla --only '"h_q": 16, "s_q": 1' --tag h16s1 --out "$OUT" --rep-ms 15 2>&1 | tee "$OUT/bench.txt" | grep -v '^\[mla' | tail -80 ;;
    sq2) timeout 45 python3 -m tilefuse bench mla --only '"h_q": 16, "s_q": 2' --tag h16s2 --out "$OUT" --rep-ms 15 2>&1 | tee "$OUT/bench_sq2.txt" | grep -v "^\[mla" | tail -5 ;;
    quick) timeout 40 python3 -m tilefuse bench mla --quick --out "$OUT" --rep-ms 15 2>&1 | tee "$OUT/bench.txt" | grep -v '^\[mla' | tail -80 ;;
  esac
done
