"""Where an MLA decode call's GPU time goes, kernel by kernel: tilefuse's and each FlashMLA build's.

    python3 tools/mla_kernel_times.py [OUT_DIR] [--calls 30] [--only SUBSTR]

The per-layer benchmark times a whole call (``tilefuse bench mla``); this splits it. For each case
(the short and 128-head batches where tilefuse trails FlashMLA per layer, and one long batch where
both run at the bytes' floor) it makes one batch, computes each library's metadata once, then
runs ``--calls`` eager attention calls of each library under ``torch.profiler`` (CUDA activities
only, warm L2, a synchronize between calls so that no two calls' kernels overlap) and reports per
kernel name its mean GPU time per call, with the sum per call and the gap between the first
kernel's start and the last one's end (launch gaps included). FlashMLA builds come from
``TILEFUSE_FLASHMLA`` as in ``tilefuse bench mla``.

Writes ``OUT_DIR/mla-kernel-times-<gpu>.json`` (default ``bench/results/sweeps``). Needs a CUDA
GPU (Hopper for the Gluon kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sweep_common import require_gpu, sweep_path, write_json

# (name, lengths, h_q, s_q)
CASES = [
    ("b16 h16 s1 4096", [4096] * 16, 16, 1),
    ("b16 h128 s1 4096", [4096] * 16, 128, 1),
    ("b128 h128 s1 1024", [1024] * 128, 128, 1),
    ("b128 h16 s1 1024", [1024] * 128, 16, 1),
    ("b3 h24 s1 70000,4097,300", [70000, 4097, 300], 24, 1),
    ("b1 h16 s1 1024", [1024], 16, 1),
    ("b16 h16 s1 65536", [65536] * 16, 16, 1),
]


def _kernel_times(fn, calls: int) -> dict:
    """``{kernel name: mean us per call}``, the sum and the first-start-to-last-end span per call,
    from ``calls`` profiled eager calls of ``fn`` (each synchronized)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    spans = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    events = [e for e in events if "Memset" not in e.name and "Memcpy" not in e.name]
    events.sort(key=lambda e: e.time_range.start)
    per_name: dict[str, list[float]] = {}
    for e in events:
        per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    # calls are separated by a synchronize: a gap of more than 20 us between kernels starts a call
    call_start = call_end = None
    for e in events:
        if call_start is None or e.time_range.start - call_end > 20:
            if call_start is not None:
                spans.append(call_end - call_start)
            call_start = e.time_range.start
        call_end = max(call_end or 0, e.time_range.end)
    if call_start is not None:
        spans.append(call_end - call_start)
    kernels = {name[:120]: round(sum(times) / calls, 2) for name, times in per_name.items()}
    return {"kernels_us": kernels, "sum_us": round(sum(kernels.values()), 2),
            "span_us": round(statistics.median(spans), 2) if spans else None, "spans_seen": len(spans)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", type=Path, default=None, help="results folder")
    ap.add_argument("--calls", type=int, default=30, help="profiled calls per library and case (default 30)")
    ap.add_argument("--only", default=None, help="only cases whose name contains this")
    args = ap.parse_args()
    require_gpu((9, 0))
    import torch

    import tilefuse
    from tilefuse.bench.mla import flashmla_peers
    from tilefuse.testing.mla import make_case

    peers = flashmla_peers()
    libraries = {"tilefuse": tilefuse, **peers}
    rows = []
    for name, lens, h_q, s_q in CASES:
        if args.only and args.only not in name:
            continue
        inp = make_case(lens, s_q, h_q, torch.bfloat16, torch.device("cuda"), nan_tail=False)
        row = {"case": name, "batch": len(lens), "h_q": h_q, "s_q": s_q, "tokens": sum(lens)}
        for label, lib in libraries.items():
            meta, splits = lib.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)

            def call(lib=lib, inp=inp, meta=meta, splits=splits):
                return lib.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                                  meta, splits, causal=True)
            try:
                row[label] = _kernel_times(call, args.calls)
            except Exception as exc:          # a peer that refuses a shape: recorded
                row[label] = {"error": str(exc).splitlines()[0][:200]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inp
        torch.cuda.empty_cache()
    write_json(sweep_path("mla-kernel-times", args.out_dir),
               {"what": __doc__.split("\n\n")[0], "peers": sorted(peers), "calls": args.calls, "rows": rows})


if __name__ == "__main__":
    main()
