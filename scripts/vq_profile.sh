#!/usr/bin/env bash
# Nsight Compute profile of the VQ decode kernels (batch 1 at 4096x4096 and 28672x8192): where the
# time goes (speed of light, warp stall reasons, scheduler, memory). Writes $OUT/ncu.txt.
set -o pipefail
OUT=${OUT:-/tmp/vq_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  --section InstructionStats -k regex:vq_decode_resident -c 2 python3 -c "
import torch, tilefuse
from tilefuse.testing.vq import make_vq_case
for m, n, k in [(1, 4096, 4096), (1, 28672, 8192)]:
    c = make_vq_case(m, n, k, torch.float16, 'cuda')
    tilefuse.vq_matmul(c['x'], c['codes'], c['codebooks'], c['scales']); torch.cuda.synchronize()
" > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"; grep -E "Duration|Throughput|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc" "$OUT/ncu.txt" | head -80
