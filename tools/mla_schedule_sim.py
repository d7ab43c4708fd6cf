"""Simulate how the GPU hands the MLA metadata's splits to SMs, against the schedule's cost model.

For each length mix: the metadata's chunk and slot count (``op._metadata_torch``, the kernel's
mirror), the cost model's expected busiest part (``configs.schedule_cost``), and a list-scheduling
simulation of the launch (programs in slot order, each to the part that frees first, each split
SPLIT_COST_PAGES pages more than its pages), plus the simulation of the best chunk found by brute
force and of the one-wave chunk. Units: 64-token pages of one part (an SM, or an SM group at
more than 64 query rows). Runs on a CPU in seconds:

    python tools/mla_schedule_sim.py
"""

from __future__ import annotations

import heapq

import torch

from tilefuse.bench.mla import serving_mixes
from tilefuse.ops.mla import configs, op


def split_pages(pages: list[int], chunk: int) -> list[int]:
    """Pages of every split, in slot order, when each request is cut in even splits of <= chunk."""
    out = []
    for p in pages:
        n = max(1, -(-p // chunk))
        per = -(-p // n) if p else 0
        out += [max(0, min(per, p - s * per)) for s in range(n)]
    return out


def list_schedule(items: list[int], parts: int) -> float:
    """Busiest part when items go, in order, to the part that frees first."""
    free = [0.0] * parts
    for pages in items:
        heapq.heappush(free, heapq.heappop(free) + pages + configs.SPLIT_COST_PAGES)
    return max(free)


def mixes() -> list[tuple[str, list[int], int]]:
    """(label, lengths, parts): the benchmark's serving mixes (one head tile: the SM count; two
    tiles: half) and three equal-length batches."""
    out = [(label, lens, 132 if s_q * h_q <= 64 else 66) for _, h_q, s_q, lens, label in serving_mixes()]
    return out + [("32 x 32768", [32768] * 32, 132), ("16 x 4096", [4096] * 16, 132), ("128 x 1024", [1024] * 128, 132)]


def main() -> None:
    print(f"{'mix':32} {'parts':>5} {'chunk':>5} {'slots':>5} {'model':>6} {'sim':>6} {'best sim':>12} {'one wave':>12}")
    for name, lens, parts in mixes():
        meta, cu = op._metadata_torch(torch.tensor(lens, dtype=torch.int32), parts)
        pages = [(n + 63) // 64 for n in lens]
        splits = (cu[1:] - cu[:-1]).tolist()
        chunk = max(-(-p // n) for p, n in zip(pages, splits))
        model = configs.schedule_cost(sum(pages), sum(splits), chunk, parts)
        sim = list_schedule(split_pages(pages, chunk), parts)
        rows = op.metadata_slots(parts, len(lens))
        fits = [c for c in range(1, max(pages) + 1) if len(split_pages(pages, c)) <= rows]
        best = min((list_schedule(split_pages(pages, c), parts), c) for c in fits)
        one_wave = next((c for c in range(1, max(pages) + 1) if len(split_pages(pages, c)) <= parts), max(pages))
        print(f"{name:32} {parts:5d} {chunk:5d} {sum(splits):5d} {model:6.0f} {sim:6.0f} "
              f"{best[0]:6.0f} (c {best[1]:3d}) {list_schedule(split_pages(pages, one_wave), parts):6.0f} (c {one_wave:3d})")


if __name__ == "__main__":
    main()
