#!/usr/bin/env bash
# Nsight Compute profile of the VQ resident decode kernel at batch 1 (4096x4096 and 28672x8192, fp16):
# where the time goes (speed of light, warp stall reasons, scheduler, occupancy, memory, instructions).
#
#   bash tools/vq_profile.sh [REPORT.txt]        # default: vq-ncu.txt in the current folder
#
# Run from the repository root on a machine with a GPU and Nsight Compute (`ncu`); the full report is
# written to REPORT.txt and its headline metrics are printed.
set -euo pipefail
source "$(dirname "$0")/profile_common.sh"
require_gpu_and_ncu tools/vq_profile.sh
report=${1:-vq-ncu.txt}
ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
  -k regex:vq_decode_resident -c 2 python3 -c "
import torch, tilefuse
from tilefuse.testing.vq import make_case
for m, n, k in [(1, 4096, 4096), (1, 28672, 8192)]:
    c = make_case(m, n, k, torch.float16, 'cuda')
    tilefuse.vq_matmul(*c.args())
    torch.cuda.synchronize()
" > "$report" 2>&1
grep -E "Duration|Throughput|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc" "$report"
