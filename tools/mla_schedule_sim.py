"""The MLA metadata's two schedules on the benchmark's length mixes, and the one it picks.

For each length mix: the parts (one head tile: the SM count; two tiles: half), the slots
schedule's chunk, split count and expected busiest part (``configs.schedule_cost``) beside a
list-scheduling simulation of its hand-out (programs in slot order, each to the part that frees
first), the parts schedule's busiest part (``configs.part_loads``) and its cost-model estimate
(``configs.parts_cost``), and which schedule the metadata picks. Units: 64-token pages of one
part (an SM, or an SM group at more than 64 query rows), split costs included. Runs on a CPU in
seconds:

    python tools/mla_schedule_sim.py
    python tools/mla_schedule_sim.py --random 2000    # the pick on random mixes the benchmark has not

``--random N`` draws N mixes the benchmark does not hold (uniform lengths up to 2K-128K, Zipf
with exponents 0.7-1.6, one to four long requests among many short ones, two-mode batches, zero
lengths among them; 1-512 requests; one or two head tiles) and, on those long enough for the pick
to weigh them (the slots' estimate >= PART_MIN_PAGES), where the metadata's pick (on the slots'
estimate) differs from the same rule applied to the simulated hand-out, and by how much: the
estimate and the threshold were checked on the benchmark's mixes; this checks them elsewhere.
``--write FILE`` saves those mixes (and as many long mixes where the two agree, as controls; at
most 16M tokens each) for ``tools/mla_split_cost_sweep.py --mixes FILE``, which times both
schedules forced on a GPU.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from pathlib import Path

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


def both(lens: list[int], parts: int) -> dict:
    """The two schedules of one mix: the slots' chunk, splits, estimate and simulated busiest part,
    the parts' busiest part and estimate, and the pick (the metadata's own, from its PyTorch
    mirror: column 7 is one slot per program under the slots)."""
    pages = [(n + 63) // 64 for n in lens]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, picked = op._metadata_torch(seqlens, parts)
    one_each = torch.arange(meta.shape[0]).clamp_max(int(picked[-1])).to(meta.dtype)
    pick = "slots" if torch.equal(meta[:, 7], one_each) else "parts"
    with_parts = configs.PART_GAIN
    configs.PART_GAIN = 0.0                     # the slots schedule alone, for its chunk
    try:
        _, cu = op._metadata_torch(seqlens, parts)
    finally:
        configs.PART_GAIN = with_parts
    counts = (cu[1:] - cu[:-1]).tolist()
    chunk = max(-(-p // n) for p, n in zip(pages, counts))
    model = configs.schedule_cost(sum(pages), sum(counts), chunk, parts)
    return {"chunk": chunk, "splits": sum(counts), "model": model,
            "sim": list_schedule(split_pages(pages, chunk), parts),
            "parts_busiest": max(configs.part_loads(pages, parts)),
            "parts_model": configs.parts_cost(pages, parts), "pick": pick}


def random_mix(rng: random.Random) -> tuple[str, list[int], int]:
    """One mix of a kind the benchmark does not hold."""
    b = rng.choice([1, 2, 3, 5, 8, 13, 24, 40, 64, 100, 160, 256, 384, 512])
    kind = rng.choice(["uniform", "zipf", "long among short", "two modes"])
    top = rng.choice([2048, 8192, 32768, 131072])
    if kind == "uniform":
        lens = [rng.randint(0, top) for _ in range(b)]
    elif kind == "zipf":
        a = rng.uniform(0.7, 1.6)
        lens = [int(top / (i + 1) ** a) for i in range(b)]
        rng.shuffle(lens)
    elif kind == "long among short":
        lens = [rng.randint(1, 2000) for _ in range(b)]
        for i in rng.sample(range(b), min(b, rng.randint(1, 4))):
            lens[i] = rng.randint(top // 2, top)
    else:
        lens = [rng.choice([rng.randint(1, 512), rng.randint(top // 4, top)]) for _ in range(b)]
    for i in rng.sample(range(b), rng.randint(0, b // 8)):
        lens[i] = 0
    return f"{kind}, b{b}, <= {top}", lens, rng.choice([132, 66])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", type=int, default=0, metavar="N", help="N random mixes instead of the benchmark's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, default=None, metavar="FILE",
                    help="with --random: save the mixes where the picks differ, and as many controls, as JSON")
    args = ap.parse_args()
    if args.random:
        rng = random.Random(args.seed)
        long_enough, differ, saved = 0, [], {"differ": [], "agree": []}
        for _ in range(args.random):
            name, lens, parts = random_mix(rng)
            r = both(lens, parts)
            if r["model"] < configs.PART_MIN_PAGES:
                continue                            # short batches: slots by rule (fixed costs dominate)
            long_enough += 1
            by_sim = "parts" if r["parts_busiest"] <= configs.PART_GAIN * r["sim"] else "slots"
            if by_sim != r["pick"]:
                picked, other = ((r["sim"], r["parts_busiest"]) if r["pick"] == "slots"
                                 else (r["parts_busiest"], r["sim"]))
                differ.append((picked / other, name, r["pick"], r["sim"], r["parts_busiest"]))
            if sum(lens) <= 16 << 20:
                saved["differ" if by_sim != r["pick"] else "agree"].append(
                    {"label": name, "lengths": lens, "parts": parts, "pick": r["pick"], "by_simulation": by_sim})
        differ.sort(reverse=True)
        print(f"{args.random} random mixes, {long_enough} with the slots' estimate >= PART_MIN_PAGES "
              f"({configs.PART_MIN_PAGES} pages); the pick on the estimates differs from the same rule on the "
              f"simulated hand-out in {len(differ)}; the picked schedule's busiest part over the other's:")
        for x, name, pick, sim, busiest in differ[:12]:
            print(f"  {x:5.2f}x  picked {pick:5}  slots simulated {sim:6.0f}, parts {busiest:6d}  ({name})")
        if args.write:
            mixes_out = saved["differ"] + saved["agree"][:len(saved["differ"])]
            args.write.write_text(json.dumps(mixes_out) + "\n")
            print(f"wrote {len(mixes_out)} mixes to {args.write}")
        return
    print(f"{'mix':34} {'parts':>5} | {'chunk':>5} {'splits':>6} {'model':>6} {'sim':>6} | {'busiest':>7} "
          f"{'model':>6} | pick")
    for name, lens, parts in mixes():
        r = both(lens, parts)
        print(f"{name:34} {parts:5d} | {r['chunk']:5d} {r['splits']:6d} {r['model']:6.0f} {r['sim']:6.0f} | "
              f"{r['parts_busiest']:7d} {r['parts_model']:6.0f} | {r['pick']}")


if __name__ == "__main__":
    main()
