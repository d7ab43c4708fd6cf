"""Measure the sparse (top-k) MLA decode's launch settings on a GPU: every candidate of
``configs.GLUON_SPARSE_CONFIGS``'s shape (the Gluon kernel: heads per tile, ring slots, warps) and
of ``configs.SPARSE_CONFIGS``'s (the tl kernel: heads per tile, tokens per step, warps, stages,
programs per SM) on DeepSeek-V3.2-sized steps (topk 2048 over 32K-token FP8 caches), timed as
CUDA-graph replays (cold L2) of the split and combine kernels alone, with FlashMLA main's sparse
decode (q padded to 64 heads below 64) in the same run where ``TILEFUSE_FLASHMLA`` names a build.

    python3 tools/mla_sparse_sweep.py [OUT_DIR] [--max-heads=N] [--min-heads=N] [--kernels=gluon|tl|all]

Writes ``OUT_DIR/mla-sparse-<gpu>.json`` (default ``bench/results/sweeps``): per case, every
candidate's time and GB/s on the bytes read, the best per head bound. Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from sweep_common import require_gpu, sweep_path
from tilefuse.bench.harness import Timer
from tilefuse.bench.mla import _sparse_peers, fp8_paged_cache
from tilefuse.testing.mla import sparse_indices
from tilefuse.ops.mla import configs, op

# (batch, h_q, s_q): V3.2 under tensor parallelism 16 / 8 (8, 16 heads), 64 and 128 heads
CASES = ((128, 16, 1), (16, 8, 1), (16, 16, 2), (128, 64, 1), (16, 128, 2), (128, 128, 1))
# (BLOCK_H, BLOCK_N, num_warps, num_stages, maxnreg) for up to 16 heads, and for more; maxnreg caps
# the registers per thread (None: the compiler's choice, 255 here) so that more programs fit an SM
FEW = [(16, n, w, s, None) for n, w, s in ((16, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 3))]
FEW += [(16, n, 4, s, r) for n, s, r in ((16, 2, 128), (32, 2, 128), (32, 3, 128), (32, 2, 168), (32, 3, 168))]
MANY = [(64, n, 8, s, None) for n, s in ((32, 3), (64, 2), (64, 3))] + [(32, 32, 4, 2, None), (32, 64, 8, 2, None),
                                                                        (32, 32, 4, 2, 168), (64, 32, 8, 2, 128),
                                                                        (64, 32, 8, 2, 168)]
WAVES = (2, 4)
# the Gluon kernel (FP8 on Hopper): (BLOCK_H, STAGES, num_warps; 8 warps split the heads in two, so
# at least 16 per tile); its parts per index list come from configs.gluon_sparse_part_tiles
GLUON = [(block_h, stages, warps) for block_h in (8, 16, 32) for stages in (2, 3) for warps in (4, 8)
         if block_h >= 2 * warps and not (block_h == 32 and stages == 3)]


def gluon_candidates(h_q: int) -> list[dict]:
    """The Gluon kernel's launches worth timing at ``h_q`` heads: tiles of 16 heads, or of up to twice
    the heads (8 heads: tiles of 8 too)."""
    return [dict(kernel="gluon", BLOCK_H=block_h, STAGES=stages, num_warps=warps)
            for block_h, stages, warps in GLUON if min(16, h_q) <= block_h <= max(16, 2 * h_q)]


def tl_candidates(h_q: int) -> list[dict]:
    out = []
    for block_h, block_n, warps, stages, maxnreg in (FEW if h_q <= 16 else MANY):
        for waves in WAVES:
            cfg = dict(kernel="tl", BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages, waves=waves)
            if maxnreg:
                cfg["maxnreg"] = maxnreg   # always, not only where the grid oversubscribes (fit_regs)
            out.append(cfg)
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith(("--max-heads=", "--min-heads=", "--kernels="))]
    kernels = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--kernels=")), "all")
    max_heads = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--max-heads=")), 128)
    min_heads = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--min-heads=")), 1)
    out_dir = Path(args[0]) if args else None
    require_gpu()
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=30.0)
    peers = _sparse_peers()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "cases": []}
    for batch, h_q, s_q in [case for case in CASES if min_heads <= case[1] <= max_heads]:
        seqlens = [32768] * batch
        gen = torch.Generator().manual_seed(h_q)
        cache, table = fp8_paged_cache(seqlens, device)
        idx, _ = sparse_indices(seqlens, s_q, 2048, table, 64, gen)
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        nbytes = batch * s_q * 2048 * 656
        entry = {"batch": batch, "h_q": h_q, "s_q": s_q, "topk": 2048, "bytes": nbytes, "default": None,
                 "candidates": [], "peers": {}}
        for name, module in peers.items():
            padded = torch.zeros(batch, s_q, max(64, h_q), 576, device=device, dtype=q.dtype)
            padded[:, :, :h_q] = q
            fp8 = cache.view(torch.float8_e4m3fn)
            entry["peers"][name] = timer.graph_us(lambda: module.flash_mla_with_kvcache(
                padded, fp8, None, None, 512, module.get_mla_metadata()[0], None, is_fp8_kvcache=True, indices=idx))
        scale = 576 ** -0.5
        sources = [(cache, idx, None)]
        entry["default"] = timer.graph_us(lambda: op._sparse_decode(q, scale, sources, None))
        candidates = ((gluon_candidates(h_q) if kernels in ("gluon", "all") else [])
                      + (tl_candidates(h_q) if kernels in ("tl", "all") else [configs.sparse_config(h_q)]))
        for cfg in candidates:
            try:
                us = timer.graph_us(lambda: op._sparse_decode(q, scale, sources, None, cfg))
                entry["candidates"].append({**cfg, "us": round(us, 2), "gbps": round(nbytes / us / 1e3)})
            except Exception as exc:   # a candidate that does not compile or fit: recorded, skipped
                entry["candidates"].append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
        timed = [c for c in entry["candidates"] if "us" in c]
        entry["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        print(f"b{batch} h{h_q} s{s_q}: default {entry['default']:.1f} us, best {entry['best']}, peers "
              f"{ {k: round(v, 1) for k, v in entry['peers'].items()} }", flush=True)
        for c in sorted(timed, key=lambda c: c["us"])[:6]:
            print("   ", c, flush=True)
        result["cases"].append(entry)
        del cache, table, idx, q
        torch.cuda.empty_cache()
    path = sweep_path("mla-sparse", out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
