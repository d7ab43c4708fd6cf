#!/usr/bin/env bash
# The shape-general dispatch on the GPU, in device-call-sized steps. Logs, JSON and tables go to
# OUT (default: $OUT, else ./corpus-gpu).
#
#   bash tools/corpus_gpu.sh tests      # GPU tests: corpus (default dispatch on every quick case),
#                                       # swiglu, racecheck, hf_mla
#   bash tools/corpus_gpu.sh corpus     # tilefuse bench corpus --quick (about 3 minutes)
#   bash tools/corpus_gpu.sh tune       # tilefuse tune on the calibration shapes below, one shape per
#                                       # call merged into OUT/tuned.json, so a cut-short run keeps them
#   bash tools/corpus_gpu.sh heldout    # tilefuse tune on the held-out models (TP 1 and 8) into
#                                       # OUT/heldout.json (not read by the dispatch), then
#                                       # tools/dispatch_check.py: the shipped dispatch against it
#
# Run from the repository root on the GPU machine (the package importable, e.g. `pip install -e .`).
set -uo pipefail
out=${OUT:-corpus-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# SwiGLU (H, I) the cost model is calibrated on: dense MLPs, routed and shared experts, TP shards,
# 96 <= I <= 53248 (none of the corpus's held-out models).
TUNE_SHAPES=${TUNE_SHAPES:-7168x2048 7168x18432 4096x14336 2048x8192 1536x8960 5120x27648 4096x1536 2048x96 6144x16384 2048x2816 5120x1024 8192x3584 16384x6656}
for what in "$@"; do
    case $what in
    tests)
        python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_corpus.py tests/test_swiglu.py \
            tests/test_racecheck.py tests/test_hf_mla.py 2>&1 | tee "$out/tests.log" | tail -n 25 ;;
    corpus)
        tilefuse bench corpus --quick --out "$out" 2> "$out/corpus.err" | tail -n 40 ;;
    tune)
        for s in $TUNE_SHAPES; do
            tilefuse tune --shapes "$s" --rep-ms 10 --out "$out/tuned.json" 2>> "$out/tune.err" | tail -n 1
        done ;;
    heldout)
        for model in phi4-14b glm4.5 llama3.2-3b mistral-nemo-12b; do
            tilefuse tune --model-type "$model" --tp 1,8 --rep-ms 10 --out "$out/heldout.json" \
                2>> "$out/heldout.err" | tail -n 1
        done
        python3 tools/dispatch_check.py "$out/heldout.json" --json "$out/heldout-check.json" | tail -n 30 ;;
    *) echo "tools/corpus_gpu.sh: unknown step $what (tests|corpus|tune|heldout)" >&2; exit 2 ;;
    esac
done
