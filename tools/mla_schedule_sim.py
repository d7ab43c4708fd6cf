"""The MLA metadata's two schedules on the benchmark's length mixes, and the one it picks.

For each length mix: the parts (one head tile: the SM count; two tiles: half), the slots
schedule's chunk, split count and expected busiest part (``configs.schedule_cost``) beside a
list-scheduling simulation of its hand-out (programs in slot order, each to the part that frees
first), the parts schedule's busiest part (``configs.part_loads``) and its cost-model estimate
(``configs.parts_cost``), and which schedule the metadata picks. Units: 64-token pages of one
part (an SM, or an SM group at more than 64 query rows), split costs included. Runs on a CPU in
seconds:

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
    """(label, lengths, parts): the benchmark's serving mixes and three equal-length batches."""
    out = [(label, lens, 132 if s_q * h_q <= 64 else 66) for _, h_q, s_q, lens, label in serving_mixes()]
    return out + [("32 x 32768", [32768] * 32, 132), ("16 x 4096", [4096] * 16, 132), ("128 x 1024", [1024] * 128, 132)]


def main() -> None:
    print(f"{'mix':34} {'parts':>5} | {'chunk':>5} {'splits':>6} {'model':>6} {'sim':>6} | {'busiest':>7} "
          f"{'model':>6} | pick")
    for name, lens, parts in mixes():
        pages = [(n + 63) // 64 for n in lens]
        with_parts = configs.PART_GAIN
        configs.PART_GAIN = 0.0                     # the slots schedule alone, for its chunk
        try:
            _, cu = op._metadata_torch(torch.tensor(lens, dtype=torch.int32), parts)
        finally:
            configs.PART_GAIN = with_parts
        counts = (cu[1:] - cu[:-1]).tolist()
        chunk = max(-(-p // n) for p, n in zip(pages, counts))
        model = configs.schedule_cost(sum(pages), sum(counts), chunk, parts)
        sim = list_schedule(split_pages(pages, chunk), parts)
        pick = "parts" if (model >= configs.PART_MIN_PAGES
                           and configs.parts_cost(pages, parts) <= configs.PART_GAIN * model) else "slots"
        print(f"{name:34} {parts:5d} | {chunk:5d} {sum(counts):6d} {model:6.0f} {sim:6.0f} | "
              f"{max(configs.part_loads(pages, parts)):7d} {configs.parts_cost(pages, parts):6.0f} | {pick}")


if __name__ == "__main__":
    main()
