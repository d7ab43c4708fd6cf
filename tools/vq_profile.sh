#!/usr/bin/env bash
# Nsight Compute profile of the VQ resident decode kernel at batch 1 (4096x4096 and 28672x8192, fp16):
# where the time goes (speed of light, warp stall reasons, scheduler, occupancy, memory, instructions,
# and per SASS instruction the warp stall samples).
#
#   bash tools/vq_profile.sh [REPORT.txt] [SUMMARY.json]
#
# Run from the repository root on a machine with a GPU and Nsight Compute (`ncu`). Writes the details
# page to REPORT.txt (default: vq-ncu.txt in the current folder), the SASS source page beside it
# (REPORT-sass.csv) and the report itself (REPORT.ncu-rep), and prints the headline metrics. With
# SUMMARY.json, tools/vq_profile_summary.py writes the stall samples by kernel stage there
# (bench/results/sweeps/vq-decode-profile-<gpu>.json is such a summary).
set -euo pipefail
source "$(dirname "$0")/profile_common.sh"
require_gpu_and_ncu tools/vq_profile.sh
report=${1:-vq-ncu.txt}
base=${report%.txt}
ncu --clock-control none --set full --import-source no -k regex:vq_decode_resident -c 2 -f -o "$base" python3 -c "
import torch, tilefuse
from tilefuse.testing.vq import make_case
for m, n, k in [(1, 4096, 4096), (1, 28672, 8192)]:
    c = make_case(m, n, k, torch.float16, 'cuda')
    tilefuse.vq_matmul(*c.args())
    torch.cuda.synchronize()
" > "$base.log" 2>&1
ncu -i "$base.ncu-rep" --page details > "$report"
ncu -i "$base.ncu-rep" --page source --csv --print-source sass > "$base-sass.csv"
grep -E "Duration|Throughput|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc" "$report"
if [ -n "${2:-}" ]; then
    python3 "$(dirname "$0")/vq_profile_summary.py" "$report" "$base-sass.csv" "$2"
fi
