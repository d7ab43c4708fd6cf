#!/usr/bin/env bash
# Nsight Compute profile of the sparse (top-k) MLA decode's split kernel (the Gluon gather kernel on
# Hopper, the tl one elsewhere) over an FP8 cache at DeepSeek-V3.2's size (topk 2048, 16 heads;
# batch 16 and 128, s_q 1): where the time goes (speed of light, warp stall reasons, scheduler,
# occupancy, memory, instructions).
#
#   bash tools/mla_sparse_profile.sh [REPORT.txt]        # default: mla-sparse-ncu.txt here
#
# Run from the repository root on a machine with a GPU and Nsight Compute (`ncu`); the full report is
# written to REPORT.txt and its headline metrics are printed.
set -euo pipefail
source "$(dirname "$0")/profile_common.sh"
require_gpu_and_ncu tools/mla_sparse_profile.sh
report=${1:-mla-sparse-ncu.txt}
ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats \
  --section SourceCounters -k "regex:mla_sparse_(split|gluon)" -c 2 python3 -c "
import torch, tilefuse
from tilefuse.bench.mla import fp8_paged_cache
from tilefuse.testing.mla import sparse_indices
for batch in (16, 128):
    lens = [32768] * batch
    cache, table = fp8_paged_cache(lens, 'cuda')
    idx, _ = sparse_indices(lens, 1, 2048, table, 64, torch.Generator().manual_seed(0))
    q = torch.randn(batch, 1, 16, 576, device='cuda', dtype=torch.bfloat16)
    tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, is_fp8_kvcache=True, indices=idx)
    torch.cuda.synchronize()
" > "$report" 2>&1
grep -E "Duration|Throughput|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory|Executed Ipc|Warp Cycles|Block Limit|Achieved|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$report"
