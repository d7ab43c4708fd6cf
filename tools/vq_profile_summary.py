"""Summarize an Nsight Compute profile of the VQ resident decode kernel: where its warps wait.

    python3 tools/vq_profile_summary.py DETAILS.txt SOURCE.csv OUT.json [--shapes 4096x4096,28672x8192]

``tools/vq_profile.sh`` writes both inputs (``ncu --page details`` and ``ncu --page source --csv
--print-source sass`` of its report) and calls this. For each profiled launch (in order, one per
``--shapes`` entry; further launches of the same shapes are ignored) it records the headline
metrics and splits the warp stall samples of the kernel's SASS into its four stages:

* prologue: up to the table build's first FMA (code words requested, x and codebooks loaded);
* table build: up to the streaming loop;
* streaming loop: the loop holding the lookups (a ``PRMT`` building a table address), from its
  backward branch's target to that branch;
* epilogue: the rest (the split-K arrival, the last program's scaling and stores).

For each stage: its share of the samples and its four largest stall reasons; for the kernel: the
instruction holding the most samples. Keys of OUT.json other than ``machine``, ``what`` and
``profile`` (an A/B of a tried variant, say) are kept when OUT.json exists.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import re
from pathlib import Path

LOOKUP = re.compile(r"\bPRMT\b.*0x76[0-3]4")     # the lookups' prmt: code byte -> table row address


def _metric(section: str, name: str) -> float | None:
    found = re.search(rf"^\s+{re.escape(name)}(?:\s+[^\d\s][^\s]*)?\s+([\d,.]+)\s*$", section, re.M)
    return float(found.group(1).replace(",", "")) if found else None


def _stages(rows: list[dict]) -> list[str]:
    """Stage name of each SASS row (see the module docstring)."""
    ops = [r["Source"].strip() for r in rows]
    addresses = [int(r["Address"], 16) for r in rows]
    first_fma = next(i for i, op in enumerate(ops) if re.search(r"\bF(FMA|MUL)\b", op))
    last_lookup = max(i for i, op in enumerate(ops) if LOOKUP.search(op))
    # the streaming loop: from the target of the first backward branch after the last lookup to it
    for end in range(last_lookup + 1, len(ops)):
        target = re.search(r"\bBRA\s+(0x[0-9a-f]+)", ops[end])
        if target and int(target.group(1), 16) < addresses[end]:
            start = addresses.index(int(target.group(1), 16))
            break
    else:
        raise ValueError("no loop found after the last lookup")
    return ["prologue" if i < first_fma else "table build" if i < start else
            "streaming loop" if i <= end else "epilogue" for i in range(len(rows))]


def summarize(details: str, source_csv: str, shapes: list[tuple[int, int]]) -> list[dict]:
    sections = details.split("vq_decode_resident_kernel (")[1:]
    blocks = source_csv.split('"Kernel Name"')[1:]
    cases = []
    for (n, k), section, block in zip(shapes, sections, blocks):
        rows = list(csv.DictReader(io.StringIO(block.split("\n", 1)[1])))
        reasons = [key for key in rows[0] if key.startswith("stall_") and "Not Issued" not in key]
        per_stage: dict[str, dict[str, int]] = {}
        for row, stage in zip(rows, _stages(rows)):
            counts = per_stage.setdefault(stage, {})
            for key in reasons:
                counts[key[6:]] = counts.get(key[6:], 0) + int(row[key] or 0)
        total = sum(sum(c.values()) for c in per_stage.values())
        hot = max(rows, key=lambda r: int(r["Warp Stall Sampling (All Samples)"] or 0))
        cases.append(dict(
            N=n, K=k, tokens=1, dtype="fp16",
            duration_us=_metric(section, "Duration"), elapsed_cycles=_metric(section, "Elapsed Cycles"),
            sm_ghz=_metric(section, "SM Frequency"),
            issued_warp_per_scheduler=_metric(section, "Issued Warp Per Scheduler"),
            eligible_warps_per_scheduler=_metric(section, "Eligible Warps Per Scheduler"),
            registers_per_thread=_metric(section, "Registers Per Thread"),
            achieved_active_warps_per_sm=_metric(section, "Achieved Active Warps Per SM"),
            executed_instructions=_metric(section, "Executed Instructions"),
            dram_throughput_pct=_metric(section, "DRAM Throughput"),
            stall_samples=total,
            regions={stage: dict(share=round(sum(c.values()) / total, 3),
                                 top_stalls={r: round(v / sum(c.values()), 3)
                                             for r, v in sorted(c.items(), key=lambda kv: -kv[1])[:4] if v})
                     for stage, c in per_stage.items()},
            hottest_instruction=dict(sass=hot["Source"].strip(),
                                     share=round(int(hot["Warp Stall Sampling (All Samples)"]) / total, 3),
                                     top_stall=max(reasons, key=lambda key: int(hot[key] or 0))[6:])))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("details", type=Path)
    ap.add_argument("source_csv", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shapes", default="4096x4096,28672x8192", help="N x K of the profiled launches, in order")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    import torch
    import triton

    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    machine = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None, torch=torch.__version__,
                   triton=triton.__version__, date=datetime.date.today().isoformat())
    what = ("Where the resident table decode (kernels_resident.py) spends its time at one token: Nsight Compute "
            "(tools/vq_profile.sh: --set full and the SASS source page, --clock-control none), warp stall "
            "samples split by the kernel's stages")
    profile = summarize(args.details.read_text(), args.source_csv.read_text(), shapes)
    args.out.write_text(json.dumps({**kept, "machine": machine, "what": what, "profile": profile}, indent=1) + "\n")
    for case in profile:
        print(f"{case['N']}x{case['K']}: {case['duration_us']} us, "
              + ", ".join(f"{s} {r['share']:.0%}" for s, r in case["regions"].items())
              + f"; hottest: {case['hottest_instruction']['sass']} ({case['hottest_instruction']['share']:.0%})")


if __name__ == "__main__":
    main()
