# Sourced by the Nsight Compute profile scripts: ends the calling script with one line on stderr and
# status 1 where torch sees no CUDA GPU or `ncu` is not on PATH.
#   require_gpu_and_ncu tools/<script>.sh
require_gpu_and_ncu() {
    if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        echo "$1: needs a CUDA GPU and torch with CUDA; python3 sees none here" >&2
        exit 1
    fi
    if ! command -v ncu > /dev/null; then
        echo "$1: needs Nsight Compute (ncu on PATH)" >&2
        exit 1
    fi
}
