#!/usr/bin/env bash
# The Gluon kernels (SwiGLU "pingpong", FP8 SwiGLU "ws", MLA "wgmma"), in one device call: their
# GPU tests, compute-sanitizer (memcheck, racecheck) on them, then the benches that time them beside the defaults. racecheck reports hazards on the
# warp-specialized kernels' cross-warpgroup hand-offs (docs/mla.md, "Compute-sanitizer"). Logs and JSON go to OUT (default: $OUT, else ./gluon-check).
#
#   bash tools/gluon_gpu_check.sh [tests|sanitize|bench|all] ...   # default: all, in that order
#
# Run from the repository root on the GPU machine (the package importable, e.g. `pip install -e .`).
# A failing step is reported and the next one still runs; the exit status is the first failure's.
# The benches time FlashMLA too when TILEFUSE_FLASHMLA (or an importable flash_mla) is set up.
set -uo pipefail
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "tools/gluon_gpu_check.sh: needs a CUDA GPU and torch with CUDA; python3 sees none here" >&2
    exit 1
fi
out=${OUT:-gluon-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
step() {   # step NAME COMMAND...: run, log to OUT/NAME.log, keep the first failure's status
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc, $((SECONDS - start)) s; tail:"
    tail -n 5 "$out/$name.log" | sed 's/^/   /'
    if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi
}

for what in "${@:-all}"; do
    if [ "$what" = tests ] || [ "$what" = all ]; then
        step tests-swiglu python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_swiglu.py -k pingpong
        step tests-fp8 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_swiglu_fp8.py -k ws
        step tests-mla python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_mla.py -k wgmma
    fi
    if [ "$what" = sanitize ] || [ "$what" = all ]; then
        export PYTORCH_NO_CUDA_MEMORY_CACHING=1
        step memcheck-swiglu compute-sanitizer --tool memcheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "swiglu pingpong"
        step memcheck-fp8 compute-sanitizer --tool memcheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "swiglu_fp8 ws"
        step memcheck-mla compute-sanitizer --tool memcheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "mla h128 wgmma" --one
        step racecheck-swiglu compute-sanitizer --tool racecheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "swiglu pingpong"
        step racecheck-fp8 compute-sanitizer --tool racecheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "swiglu_fp8 ws" --one
        step racecheck-mla compute-sanitizer --tool racecheck --error-exitcode 1 \
            python3 tools/sanitize.py --only "mla h16 wgmma" --one
        unset PYTORCH_NO_CUDA_MEMORY_CACHING
    fi
    if [ "$what" = bench ] || [ "$what" = all ]; then
        step bench-mla python3 -m tilefuse bench mla --quick --out "$out"
        step bench-swiglu python3 -m tilefuse bench swiglu --quick --out "$out"
        step bench-fp8 python3 -m tilefuse bench swiglu_fp8 --quick --out "$out"
        step tune-pingpong python3 tools/tune_swiglu.py "$out" --mode pingpong
    fi
done
exit $status
