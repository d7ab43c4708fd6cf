"""Sweep the launch settings of the MLA decode kernels on a GPU and pick one per kernel and regime.

    python3 tools/mla_sweep.py [OUT_DIR] [--quick] [--configs FILE]
    TILEFUSE_CONFIGS=configs.json tilefuse bench mla          # then measure the picks

Config keys (``tilefuse/ops/mla/configs.py``): ``transposed`` (below 64 query rows),
``standard_small`` (the standard orientation below 64 rows) and ``standard`` (64+ rows). Each
candidate of a key runs in a fresh process with a ``TILEFUSE_CONFIGS`` file that sets it for the
key in both context regimes, and is timed as CUDA-graph replays (cold L2) of the attention call
(metadata computed once, outside) on the sweep shapes the key applies to.

Picks, per key and regime (``short``: contexts below 16K, ``long``: 16K and more, the side of the
op's block-table proxy), the candidate with the best geomean speedup over the first one (the
current default) unless none beats it by ``--margin``; and per regime the orientation at <= 16
rows (the faster of the two picks on the shapes both ran). Merges them into the ``"mla"``
section of the configs file (``"<key>:<regime>": config`` entries and ``"small_rows_variant"``);
every time goes to ``OUT_DIR/mla-sweep-<gpu>.json`` (default ``bench/results/sweeps/``). Needs a
CUDA GPU.
"""

from __future__ import annotations

import json
import math
import sys

from sweep_common import (merge_section, parse_args, read_configs, run_with_configs, sweep_path, update_section,
                          write_json)

# (batch, h_q, s_q, context)
SHAPES = [(16, 16, 1, 1024), (16, 16, 1, 4096), (64, 16, 1, 4096), (32, 16, 1, 16384), (16, 16, 1, 65536),
          (16, 32, 1, 16384), (16, 128, 1, 16384), (64, 128, 1, 4096)]
QUICK_SHAPES = [(16, 16, 1, 4096), (16, 16, 1, 65536), (16, 32, 1, 16384), (64, 128, 1, 4096)]
LONG_CONTEXT = 16384
# The first candidate of each key is the current default; "impl" is the bench impl that runs it.
_TRANSPOSED = dict(BLOCK_N=64, num_warps=4, num_stages=2, slot_programs=1, fused_combine=False)
_TWO_PER_SM = dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=3, slot_programs=2, fused_combine=False)
_STANDARD = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, slot_programs=1, fused_combine=True)
KEYS = {
    "transposed": {"impl": "tilefuse:transposed", "applies": lambda rows: rows < 64,
                   "candidates": [_TRANSPOSED, dict(_TRANSPOSED, fused_combine=True)]},
    "standard_small": {"impl": "tilefuse:standard", "applies": lambda rows: rows <= 16,
                       "candidates": [_TWO_PER_SM, dict(_TWO_PER_SM, fused_combine=True)]},
    "standard": {"impl": "tilefuse", "applies": lambda rows: rows >= 64,
                 "candidates": [_STANDARD, dict(_STANDARD, fused_combine=False), dict(_STANDARD, num_warps=16)]},
}


def regime(context: int) -> str:
    return "long" if context >= LONG_CONTEXT else "short"


def measure(key: str, quick: bool) -> list[dict]:
    """Worker (one process): graph-replay time of ``key``'s impl on the shapes it applies to, with
    the launch settings of this process's ``TILEFUSE_CONFIGS``."""
    import torch

    from tilefuse.bench import mla
    from tilefuse.bench.harness import Timer

    timer = Timer(torch.device("cuda"), rep_ms=15.0, warmup_ms=5.0)
    rows = []
    for batch, h_q, s_q, ctx in QUICK_SHAPES if quick else SHAPES:
        if not KEYS[key]["applies"](h_q * s_q):
            continue
        case = mla.mla_case(batch, h_q, s_q, [ctx] * batch, torch.device("cuda"), torch.bfloat16, naive=False)
        impls = case.setup()
        try:
            us, error = timer.graph_us(impls[KEYS[key]["impl"]]), None
        except Exception as exc:  # a config that does not compile or fit is reported, never picked
            us, error = None, f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append({"shape": [batch, h_q, s_q, ctx], "us": us, "error": error})
        print(f"{key} b{batch} h{h_q} s{s_q} {ctx:6d}: {us if us is None else round(us, 1)} us {error or ''}",
              file=sys.stderr, flush=True)
        del impls
        mla.clear_cache()
    return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def pick(timed: dict, margin: float) -> tuple[dict, dict]:
    """(picks {"<key>:<regime>": config index}, orientation at <= 16 rows {regime: variant})."""
    picks = {}
    for key, spec in KEYS.items():
        for reg in ("short", "long"):
            times = [{tuple(r["shape"]): r["us"] for r in rows if regime(r["shape"][3]) == reg}
                     for rows in timed[key]]
            if not times[0] or not all(times[0].values()):
                continue
            # geomean speedup of each candidate over the default, on the shapes the default ran
            speedup = {i: geomean(times[0][s] / t[s] for s in times[0]) for i, t in enumerate(times)
                       if all(t.get(s) for s in times[0])}
            best = max(speedup, key=lambda i: speedup[i] / (margin if i else 1.0))
            picks[f"{key}:{reg}"] = best
            print(f"{key} ({reg}): #{best} {spec['candidates'][best]}  (speedup over #0: "
                  + ", ".join(f"#{i} {v:.3f}" for i, v in sorted(speedup.items())) + ")")
    small = {}
    for reg in ("short", "long"):
        if f"transposed:{reg}" not in picks or f"standard_small:{reg}" not in picks:
            continue
        tr, st = ({tuple(r["shape"]): r["us"] for r in timed[k][picks[f"{k}:{reg}"]]
                   if regime(r["shape"][3]) == reg and r["shape"][1] * r["shape"][2] <= 16}
                  for k in ("transposed", "standard_small"))
        common = tr.keys() & st.keys()
        if common:
            ratio = geomean(st[s] / tr[s] for s in common)   # > 1: transposed is faster
            small[reg] = "transposed" if ratio > 1 else "standard"
            print(f"<= 16 rows, {reg}: {small[reg]} (standard / transposed time {ratio:.3f})")
    return picks, small


def main() -> None:
    args = parse_args(__doc__, **{"--margin": dict(type=float, default=1.02,
                                                   help="speedup a candidate needs over the default")})
    if args.measure:
        print(json.dumps(measure(args.measure, args.quick)))
        return
    base = read_configs(args.configs)
    timed = {}
    for key, spec in KEYS.items():
        timed[key] = []
        for cfg in spec["candidates"]:
            print(f"{key}: {cfg}", file=sys.stderr, flush=True)
            trial = merge_section(base, "mla", {key: cfg, f"{key}:short": cfg, f"{key}:long": cfg})
            argv = [__file__, "--measure", key] + (["--quick"] if args.quick else [])
            timed[key].append(run_with_configs(trial, argv))
    picks, small = pick(timed, args.margin)
    section = {name: KEYS[name.split(":")[0]]["candidates"][idx] for name, idx in picks.items()}
    if small:
        section["small_rows_variant"] = small
    write_json(sweep_path("mla-sweep", args.out_dir),
               {"candidates": {k: s["candidates"] for k, s in KEYS.items()}, "times": timed, "picks": section},
               quick=args.quick)
    update_section(args.configs, "mla", section)
    print(f"merged into {args.configs}: TILEFUSE_CONFIGS={args.configs} tilefuse bench mla")


if __name__ == "__main__":
    main()
