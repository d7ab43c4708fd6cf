#!/usr/bin/env bash
# The dense FP8 decode's GPU check in one device call: the GPU tests of the Gluon FP8 kernel
# (tests/test_mla_fp8_gluon.py, and tests/test_mla.py's FP8 GPU tests) in parallel processes
# beside compile warm-ups of the A/B sweep's launches (correctness only: they share the GPU), then
# tools/mla_fp8_sweep.py's timings alone on the GPU. Logs (logs.tgz) and the sweep's JSON go to
# OUT (default: $OUT, else ./fp8-check). Run from the repository root on the GPU machine.
#
#   bash tools/mla_fp8_gpu_check.sh [PYTEST_PROCS] [WARM_SHARDS]      # default: 6 and 4
#
# PYTEST_K: the tests' -k expression (default: every FP8 GPU test); SWEEP_ARGS: the sweep's
# arguments (e.g. "--cases a47 --forms ws,rs --no-tl --no-ablate"); the timed run adds --accuracy.
set -uo pipefail
out=${OUT:-fp8-check}
mkdir -p "$out/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
procs=${1:-6}
shards=${2:-4}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
start=$SECONDS
ids=$(python3 -m pytest -q --collect-only -p no:cacheprovider tests/test_mla_fp8_gluon.py tests/test_mla.py \
      -k "${PYTEST_K:-test_mla_fp8_gluon or (gpu and fp8)}" | grep "::")
echo "$(echo "$ids" | wc -l) tests in $procs processes, $shards warm-up shards"
pids=()
for ((k = 0; k < procs; k++)); do
    mine=$(echo "$ids" | awk -v k="$k" -v n="$procs" '(NR - 1) % n == k')
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider $mine > "$out/logs/pytest-$k.log" 2>&1 &
    pids+=($!)
done
for ((k = 0; k < shards; k++)); do
    # shellcheck disable=SC2086
    python3 tools/mla_fp8_sweep.py --warm --shard "$k/$shards" ${SWEEP_ARGS:-} > "$out/logs/warm-$k.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
echo "tests + warm-ups: $((SECONDS - start)) s, status $status"
grep -h -E "passed|failed|error" "$out"/logs/pytest-*.log | tail -n "$procs"
grep -h -E "^(FAILED|ERROR)" "$out"/logs/pytest-*.log | head -40
grep -h -i -E "error|Traceback" "$out"/logs/warm-*.log | head -10
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
# the timed run alone on the GPU (SWEEP_TIMEOUT seconds at most; the JSON is written after each case)
# shellcheck disable=SC2086
timeout "${SWEEP_TIMEOUT:-900}" python3 tools/mla_fp8_sweep.py "$out/mla-fp8-ws.json" ${SWEEP_ARGS:-} --accuracy \
    > "$out/sweep.log" 2>&1 || status=1
grep -v "^{" "$out/sweep.log"
exit $status
