"""The MLA metadata's schedule on the benchmark's length mixes: how evenly it loads the parts.

For each length mix: the parts (one head tile: the SM count; two tiles: half), the splits the
metadata makes (``op._metadata_torch``, the kernel's mirror), the busiest part's work and the
balanced share (pages plus ``configs.SPLIT_COST_PAGES`` per split, ``configs.part_loads``), and
the same for the one-split-per-request schedule (each request whole, requests handed to the part
that frees first) for comparison. Units: 64-token pages of one part. Runs on a CPU in seconds:

    python tools/mla_schedule_sim.py
"""

from __future__ import annotations

import heapq

import torch

from tilefuse.bench.mla import serving_mixes
from tilefuse.ops.mla import configs, op


def whole_requests(pages: list[int], parts: int) -> int:
    """Busiest part when every request runs whole, in order, on the part that frees first."""
    free = [0] * parts
    for p in pages:
        heapq.heappush(free, heapq.heappop(free) + p + configs.SPLIT_COST_PAGES)
    return max(free)


def mixes() -> list[tuple[str, list[int], int]]:
    """(label, lengths, parts): the benchmark's serving mixes and three equal-length batches."""
    out = [(label, lens, 132 if s_q * h_q <= 64 else 66) for _, h_q, s_q, lens, label in serving_mixes()]
    return out + [("32 x 32768", [32768] * 32, 132), ("16 x 4096", [4096] * 16, 132), ("128 x 1024", [1024] * 128, 132)]


def main() -> None:
    print(f"{'mix':34} {'parts':>5} {'splits':>6} {'busiest':>7} {'share':>7} {'whole requests':>14}")
    for name, lens, parts in mixes():
        meta, cu = op._metadata_torch(torch.tensor(lens, dtype=torch.int32), parts)
        pages = [(n + 63) // 64 for n in lens]
        share = (sum(pages) + configs.SPLIT_COST_PAGES * len(pages)) / parts
        print(f"{name:34} {parts:5d} {int(cu[-1]):6d} {max(configs.part_loads(pages, parts)):7d} {share:7.1f} "
              f"{whole_requests(pages, parts):14d}")


if __name__ == "__main__":
    main()
