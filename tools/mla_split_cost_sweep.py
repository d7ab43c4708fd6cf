"""Measure the MLA schedule's split cost on a GPU: the attention call's time under the schedules
that each value of ``configs.SPLIT_COST_PAGES`` picks, on the benchmark's length mixes.

    python3 tools/mla_split_cost_sweep.py [OUT.json] [--mixes FILE] [--costs 8]

``--mixes FILE``: the mixes ``tools/mla_schedule_sim.py --random N --write FILE`` saved (where the
pick on the slots' estimate and on the simulated hand-out differ, and controls) instead of the
benchmark's, each at 16 query rows per KV head (132 parts) or 128 (66 parts) as saved there.

For every mix and every candidate split cost, the metadata (``op._metadata_torch``, the metadata
kernel's mirror) with that cost; each distinct schedule (its splits and parts) is timed once as CUDA-graph
replays of ``flash_mla_with_kvcache`` alone (cold L2), the default schedule twice (the noise).
The summary gives, per split cost, the geomean over the mixes of its time over the best schedule
found for that mix; each mix also records both schedules forced (``forced``: slots only, parts
only), the pick's cost model set aside. Writes ``bench/results/sweeps/mla-split-cost-<gpu>.json`` by default. Needs
a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from sweep_common import require_gpu

import tilefuse
from tilefuse.bench.harness import Timer
from tilefuse.bench.mla import serving_mixes
from tilefuse.ops.mla import configs, op
from tilefuse.testing.mla import paged_cache

COSTS = (1, 2, 4, 6, 8, 12, 16, 24)


def mixes() -> list[tuple[str, int, int, list[int]]]:
    """(label, h_q, s_q, lengths): the benchmark's serving mixes and five equal-length batches."""
    out = [(label, h_q, s_q, lens) for _, h_q, s_q, lens, label in serving_mixes()]
    out += [("16 x 4096", 16, 1, [4096] * 16), ("64 x 16384", 16, 1, [16384] * 64), ("64 x 4096, 128 heads", 128, 1,
                                                                                      [4096] * 64),
            ("16 x 65536, 128 heads", 128, 1, [65536] * 16), ("32 x 16384, 128 heads", 128, 1, [16384] * 32)]
    return out


def saved_mixes(path: Path) -> list[tuple[str, int, int, list[int]]]:
    """(label, h_q, s_q, lengths) of the mixes tools/mla_schedule_sim.py --write saved."""
    return [(f"{m['label']} (picked {m['pick']}, simulation {m['by_simulation']})", 16 if m["parts"] == 132 else 128, 1,
             m["lengths"]) for m in json.loads(path.read_text())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file")
    ap.add_argument("--mixes", type=Path, default=None, help="mixes saved by mla_schedule_sim.py --write")
    ap.add_argument("--costs", type=lambda v: tuple(int(x) for x in v.split(",")), default=COSTS,
                    help=f"split costs to try (default {','.join(map(str, COSTS))})")
    args = ap.parse_args()
    require_gpu()
    costs = tuple(sorted(set(args.costs) | {configs.SPLIT_COST_PAGES}))
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=30.0)
    default_cost = configs.SPLIT_COST_PAGES
    rows_out = []
    for label, h_q, s_q, lens in (saved_mixes(args.mixes) if args.mixes else mixes()):
        # paged_cache holds batch x the longest request's pages, made in fp32 first
        need = len(lens) * -(-max(lens) // 64) * 64 * 576 * (4 + 2)
        if need > 0.8 * torch.cuda.mem_get_info(device)[0]:
            print(f"{label}: skipped, its cache ({need / 2**30:.0f} GiB to build) exceeds the free memory", flush=True)
            continue
        k_cache, block_table = paged_cache(lens, torch.bfloat16, device, nan_tail=False)
        q = torch.randn(len(lens), s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        parts = op.default_num_sm_parts(device, s_q * h_q)
        times: dict[tuple, float] = {}
        entry = {"mix": label, "batch": len(lens), "h_q": h_q, "s_q": s_q, "parts": parts, "costs": {}}
        for cost in costs:
            configs.SPLIT_COST_PAGES = cost
            meta, splits = op._metadata_torch(seqlens, parts)
            configs.SPLIT_COST_PAGES = default_cost
            pages = [(n + 63) // 64 for n in lens]
            key = (meta.cpu().numpy().tobytes(), int(splits[-1]))
            repeats = 2 if cost == default_cost else 1
            if key not in times or cost == default_cost:
                call = lambda: tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512,  # noqa: E731
                                                               meta, splits, causal=True)
                samples = [timer.graph_us(call) for _ in range(repeats)]
                times[key] = min(samples) if key not in times else min(times[key], *samples)
                if cost == default_cost:
                    entry["default_samples_us"] = samples
            entry["costs"][str(cost)] = {"splits": key[1], "busiest_part_pages": max(configs.part_loads(pages, parts, cost)),
                                         "graph_us": times[key]}
        # each schedule forced (the pick's cost model set aside): slots only, parts only
        entry["forced"] = {}
        for name, gain, min_pages in (("slots", 0.0, configs.PART_MIN_PAGES), ("parts", 1e9, 0)):
            saved = configs.PART_GAIN, configs.PART_MIN_PAGES
            configs.PART_GAIN, configs.PART_MIN_PAGES = gain, min_pages
            meta, splits = op._metadata_torch(seqlens, parts)
            configs.PART_GAIN, configs.PART_MIN_PAGES = saved
            call = lambda: tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512,  # noqa: E731
                                                           meta, splits, causal=True)
            entry["forced"][name] = {"splits": int(splits[-1]), "graph_us": timer.graph_us(call)}
        best = min(times.values())
        for v in entry["costs"].values():
            v["x_best"] = v["graph_us"] / best
        rows_out.append(entry)
        print(label, h_q, s_q, {c: (v["splits"], round(v["graph_us"], 1)) for c, v in entry["costs"].items()},
              {name: round(v["graph_us"], 1) for name, v in entry["forced"].items()}, flush=True)
        del k_cache, block_table
        torch.cuda.empty_cache()
    summary = {str(c): math.exp(sum(math.log(r["costs"][str(c)]["x_best"]) for r in rows_out) / len(rows_out))
               for c in costs}
    print("geomean time over each mix's best schedule, per split cost:", {c: round(v, 3) for c, v in summary.items()})
    gpu = torch.cuda.get_device_name(device).replace(" ", "-").lower()
    path = args.out or Path(f"bench/results/sweeps/mla-split-cost-{gpu}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d")}
    path.write_text(json.dumps({"machine": machine, "costs": list(costs), "default": default_cost, "rows": rows_out,
                                "geomean_x_best": summary}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
