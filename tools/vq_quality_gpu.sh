#!/usr/bin/env bash
# SmolLM2 quality variants side by side on one GPU, in one device call: each variant is one
# tools/vq_quality.py run (the whole pipeline: sequential calibration, block fine-tuning, end-to-end
# KL tuning), all started at once (the model is small: each run keeps the GPU busy a few percent of
# the time, the host is what limits it), each under its own time limit so that a slow one cannot
# take the others' results with it. Logs and JSON go to OUT_DIR (<variant>.json, <variant>.log).
#
#   tools/vq_quality_gpu.sh GGUF TEXT_DIR OUT_DIR LIMIT_S 'name: extra vq_quality.py flags' ...
#
# The flags every variant shares are the committed H200 run's (docs/vq_quality.md: beam 3, 104
# block steps at 1e-3, the KL and the RMSNorm weights end to end at 3e-4, Matthew 1 - Luke 24);
# a variant's flags come after them, so they can override any of them.
set -uo pipefail
gguf=$1; text=$2; out=$3; limit=$4; shift 4
mkdir -p "$out"
common=(--methods vq2x8_calib_seq_ft_e2e --beam 3 --ft-steps 104 --ft-lr 1e-3 --e2e-steps 780 --e2e-lr 3e-4
        --calib-text "Matt1:1-Luke24:53" --e2e-loss kl --e2e-norms --e2e-eval-every 78 --device cuda)
for spec in "$@"; do
    name=${spec%%:*}; flags=${spec#*:}
    # shellcheck disable=SC2086  # the variant's flags split on spaces on purpose
    OMP_NUM_THREADS=3 timeout "$limit" python3 tools/vq_quality.py "${common[@]}" --gguf "$gguf" --text-dir "$text" \
        $flags --out "$out/$name.json" > "$out/$name.log" 2>&1 &
done
wait
for spec in "$@"; do
    name=${spec%%:*}
    echo "== $name: $(grep -h 'end to end: step\|vq2x8_calib_seq_ft_e2e:' "$out/$name.log" | tr '\n' ' ' | cut -c1-600)"
done
