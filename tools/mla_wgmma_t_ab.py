"""Same-run A/B of the Gluon MLA kernel's candidate forms against the shipped default, per case:

* ``--cases wgmma_t`` (default, candidate ``wgmma_t``): the transposed form (``kernels_gluon_t``, up
  to 32 query rows) against the 64-row head tiles, on tilefuse bench mla's cases of <= 32 query
  rows and on batches the benchmark does not hold (uneven, Zipf, one long among many short, s_q
  1-4, 1-32 query rows per KV head);
* ``--cases levers`` (candidates: the plain path, ``plain``, and the per-call levers of
  ``configs.WGMMA_LEVERS`` each alone on it: ``pdl1``, ``pdl2``, ``fused16``, ``fused_all``,
  ``q_ahead``; ``seesaw`` (the seesaw form, on the shipped levers); ``fused16_pdl1`` and ``combine32x4``, the combine launch's candidate settings, on
  request): the benchmark's short and uneven cases where a fixed per-call cost shows, held-out
  short and small batches, and two long ones (no loss there).

Each is the attention call alone (its metadata computed once, as a model runs every layer after
one metadata call), timed as CUDA-graph replays (cold L2, do_bench median; the default timed
before and after the candidates, their mean the baseline), with the FlashMLA builds named in
``TILEFUSE_FLASHMLA`` (``tilefuse.bench.mla.flashmla_peers``) timed the same way beside it; each
candidate's output is checked against the default's first (relative error).

    python3 tools/mla_wgmma_t_ab.py [OUT.json] [--rep-ms MS] [--no-bench-cases]
    python3 tools/mla_wgmma_t_ab.py [OUT.json] --cases levers [--candidates fused16,pdl1] [--warm]

Writes ``bench/results/sweeps/mla-wgmma-t-<gpu>.json`` (``mla-levers-<gpu>.json``) by default
(after every case: a run cut short keeps what it measured). ``--warm``: each candidate run once
per case, nothing timed (compiles ahead, e.g. beside the tests). Needs a CUDA GPU (Hopper for
the Gluon kernels).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from sweep_common import require_gpu

import tilefuse
from tilefuse.bench.harness import Timer, geomean
from tilefuse.bench.mla import flashmla_peers
from tilefuse.ops.mla import configs


def _uneven(batch: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(batch)]


def _zipf(batch: int, top: int, power: float) -> list[int]:
    return [max(1, int(top / (i + 1) ** power)) for i in range(batch)]


# (name, lengths, h_q, s_q): tilefuse bench mla's cases of <= 32 query rows (page 64), then batches
# that are not in its grid
BENCH_CASES = [
    ("bench b16 h16 s1 4096", [4096] * 16, 16, 1),
    ("bench b16 h16 s1 65536", [65536] * 16, 16, 1),
    ("bench b64 h16 s1 4096", [4096] * 64, 16, 1),
    ("bench b32 h32 s1 16384", [16384] * 32, 32, 1),
    ("bench b64 h16 s2 8192 each", [8192] * 64, 16, 2),
    ("bench b3 h8 s4 1,300,70000", [1, 300, 70000], 8, 4),
    ("bench b128 h16 s1 1024", [1024] * 128, 16, 1),
]
CASES = [
    ("b200 h16 s1 Zipf 128K / i^1.1", _zipf(200, 131072, 1.1), 16, 1),
    ("b32 h16 s1 uneven 1K-40K", _uneven(32, 1024, 40960, 1), 16, 1),
    ("b64 h4 s1 8K", [8192] * 64, 4, 1),
    ("b48 h32 s1 uneven 1K-60K", _uneven(48, 1024, 61440, 2), 32, 1),
    ("b24 h8 s4 uneven 4K-32K", _uneven(24, 4096, 32768, 3), 8, 4),
    ("b64 h16 s2 uneven 1-16K", _uneven(64, 1, 16384, 4), 16, 2),
    ("b4 h8 s3 1,500,9000,120000", [1, 500, 9000, 120000], 8, 3),
    ("b8 h16 s1 Zipf 64K / i^1.5", _zipf(8, 65536, 1.5), 16, 1),
    ("b160 h16 s1 one 100000, 159 uniform 1-3000", [100000] + _uneven(159, 1, 3000, 5), 16, 1),
    ("b96 h2 s1 uniform 1-20000", _uneven(96, 1, 20000, 6), 2, 1),
]
# the per-call levers' cases: (name, lengths, h_q, s_q)
_ZIPF128 = (20000 / torch.arange(1, 129, dtype=torch.float64) ** 1.1).long().clamp_min(1).tolist()
LEVER_CASES = [
    ("bench b16 h16 s1 4096", [4096] * 16, 16, 1),
    ("bench b16 h128 s1 4096", [4096] * 16, 128, 1),
    ("bench b64 h16 s1 4096", [4096] * 64, 16, 1),
    ("bench b128 h16 s1 1024", [1024] * 128, 16, 1),
    ("bench b128 h16 s2 Zipf 20000 / i^1.1", _ZIPF128, 16, 2),
    ("bench b128 h64 s1 Zipf 20000 / i^1.1", _ZIPF128, 64, 1),
    ("bench b3 h24 s1 70000,4097,300", [70000, 4097, 300], 24, 1),
    ("b8 h16 s1 Zipf 64K / i^1.5", _zipf(8, 65536, 1.5), 16, 1),
    ("b160 h16 s1 one 100000, 159 uniform 1-3000", [100000] + _uneven(159, 1, 3000, 5), 16, 1),
    ("b1 h16 s1 1024", [1024], 16, 1),
    ("b2 h128 s2 4096,2000", [4096, 2000], 128, 2),
    ("b4 h16 s1 1024-4096", [1024, 2048, 3072, 4096], 16, 1),
    ("b4 h64 s2 uneven 1K-4K", _uneven(4, 1024, 4096, 7), 64, 2),
    ("b32 h128 s1 2048", [2048] * 32, 128, 1),
    ("long b16 h16 s1 65536", [65536] * 16, 16, 1),
    ("long b64 h128 s1 16384", [16384] * 64, 128, 1),
    # held out from the combine rule's choice (configs.combine_settings): 96-128 programs
    ("held b2 h64 s1 8192,30000", [8192, 30000], 64, 1),
    ("held b1 h128 s1 16384", [16384], 128, 1),
    ("held b6 h16 s1 uneven 1K-32K", _uneven(6, 1024, 32768, 11), 16, 1),
    ("held b3 h8 s4 1,300,70000", [1, 300, 70000], 8, 4),
    # held out from the combine rule (partials per load by the schedule's parts per request)
    ("held2 b5 h128 s1 8192", [8192] * 5, 128, 1),
    ("held2 b10 h16 s1 32768", [32768] * 10, 16, 1),
    ("held2 b24 h16 s1 4096", [4096] * 24, 16, 1),
    ("held2 b64 h128 s1 2048", [2048] * 64, 128, 1),
    ("held2 b12 h32 s2 uneven 2K-40K", _uneven(12, 2048, 40960, 13), 32, 2),
    ("held2 b256 h16 s1 512", [512] * 256, 16, 1),
]
# candidate name -> its switches: "wgmma_t_max_rows" (configs.TRANSPOSED_GLUON_MAX_ROWS) or levers
# (each lever alone on the plain path: PDL 0 where the lever is not PDL)
CANDIDATES = {
    "wgmma_t": {"wgmma_t_max_rows": 32},
    "plain": {"PDL": 0, "FUSED_SPLITS": 0, "Q_AHEAD": False},
    "pdl1": {"PDL": 1, "FUSED_SPLITS": 0, "Q_AHEAD": False},
    "pdl2": {"PDL": 2, "FUSED_SPLITS": 0, "Q_AHEAD": False},
    "fused16": {"FUSED_SPLITS": 16, "PDL": 0, "Q_AHEAD": False},
    "fused_all": {"FUSED_SPLITS": 1 << 20, "PDL": 0, "Q_AHEAD": False},
    "q_ahead": {"Q_AHEAD": True, "PDL": 0, "FUSED_SPLITS": 0},
    # the seesaw form (two MMA warpgroups alternating tiles) on the shipped levers
    "seesaw": {"SEESAW": 1},
    "fused16_pdl1": {"FUSED_SPLITS": 16, "PDL": 1, "Q_AHEAD": False},
    # the combine launch reading 32 partials per load over a quarter of the columns (shipped levers)
    "combine32x4": {"COMBINE_S_CHUNK": 32, "COMBINE_COL_BLOCKS": 4},
    # the combine's rule (configs.combine_settings) against the fixed form before it (8 partials
    # per load over all the columns)
    "combine8x1": {"COMBINE_S_CHUNK": 8, "COMBINE_COL_BLOCKS": 1},
    # several query rows per combine program (the rule's picks otherwise)
    "combine_rows2": {"COMBINE_ROWS": 2},
    "combine_rows4": {"COMBINE_ROWS": 4},
    "combine_rows8": {"COMBINE_ROWS": 8},
    # each of the combine's two settings alone (the chunk of partials per load; the columns' split)
    "combine8x4": {"COMBINE_S_CHUNK": 8, "COMBINE_COL_BLOCKS": 4},
    "combine8x2": {"COMBINE_S_CHUNK": 8, "COMBINE_COL_BLOCKS": 2},
    "combine32x1": {"COMBINE_S_CHUNK": 32, "COMBINE_COL_BLOCKS": 1},
    "combine16x1": {"COMBINE_S_CHUNK": 16, "COMBINE_COL_BLOCKS": 1},
}
LEVER_CANDIDATES = "plain,pdl1,pdl2,fused16,fused_all,q_ahead"
MAX_REL_ERR = 1e-2       # two bf16 roundings of out, different products' orders


def _compact_cache(lens: list[int], device, page: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 paged cache holding only each request's own pages (a Zipf batch's longest request
    would otherwise give every request its page count), N(0, 1) values, shuffled pages; the
    block table's unused columns point at page 0 (never read: past the lengths)."""
    pages = [-(-n // page) for n in lens]
    total = max(sum(pages), 1)
    cache = torch.empty(total, page, 1, 576, dtype=torch.bfloat16, device=device)
    for first in range(0, total, 4096):
        last = min(first + 4096, total)
        cache[first:last] = torch.randn(last - first, page, 1, 576, device=device)
    order = torch.randperm(total)
    table = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    return cache, table.to(device)


def _with_switch(attention, switches: dict):
    """``attention`` run with ``switches`` set (and restored after each call)."""
    switches = dict(switches)
    max_rows = switches.pop("wgmma_t_max_rows", 0)

    def run():
        saved, configs.TRANSPOSED_GLUON_MAX_ROWS = configs.TRANSPOSED_GLUON_MAX_ROWS, max_rows
        try:
            with configs.wgmma_levers(**switches):
                return attention()
        finally:
            configs.TRANSPOSED_GLUON_MAX_ROWS = saved
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file")
    ap.add_argument("--rep-ms", type=float, default=20.0, help="do_bench window per measurement (ms)")
    ap.add_argument("--no-bench-cases", action="store_true", help="the held-out batches only")
    ap.add_argument("--cases", choices=("wgmma_t", "levers"), default="wgmma_t", help="which A/B (see above)")
    ap.add_argument("--candidates", default=None,
                    help=f"comma-separated names of {sorted(CANDIDATES)} (default: wgmma_t, or with "
                         f"--cases levers {LEVER_CANDIDATES})")
    ap.add_argument("--warm", action="store_true", help="run each candidate once per case, time nothing")
    ap.add_argument("--only", default=None, help="cases whose name contains this text")
    args = ap.parse_args()
    names = (args.candidates or ("wgmma_t" if args.cases == "wgmma_t" else LEVER_CANDIDATES)).split(",")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"--candidates: expected names from {sorted(CANDIDATES)}, got {unknown}")
    require_gpu()
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=args.rep_ms)
    gpu = torch.cuda.get_device_name(device)
    stem = "mla-wgmma-t" if args.cases == "wgmma_t" else "mla-levers"
    path = args.out or Path(f"bench/results/sweeps/{stem}-{gpu.replace(' ', '-').lower()}.json")
    copy_gbps = 0.0
    if not args.warm:
        src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() * 2 / timer.gpu_us(lambda: dst.copy_(src)) / 1e3
        del src, dst
    peers = {} if args.warm else flashmla_peers()
    machine = {"gpu": gpu, "torch": torch.__version__, "triton": __import__("triton").__version__,
               "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "peers": sorted(peers)}
    print(f"{gpu}: copy bandwidth {copy_gbps:.0f} GB/s, peers {sorted(peers)}", flush=True)
    rows: list[dict] = []

    def write():
        if args.warm:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {}
        for cand in names:
            ratios = [r["default_us"] / r[f"{cand}_us"] for r in rows if r.get(f"{cand}_us")]
            summary[cand] = {"switches": CANDIDATES[cand], "speedup_geomean": geomean(ratios) if ratios else None,
                             "faster_in": sum(x > 1 for x in ratios), "of": len(ratios)}
            if len(names) == 1:          # the single-candidate form of the file
                summary.update(summary.pop(cand))
        path.write_text(json.dumps({"machine": machine, "copy_gbps": copy_gbps, "timing": (
            "attention alone (metadata once), CUDA-graph replay, cold L2, do_bench median over rep_ms; "
            "default_us: the mean of the default timed before and after the candidates"),
            "rep_ms": args.rep_ms, "candidates": {c: CANDIDATES[c] for c in names}, "summary": summary,
            "rows": rows}, indent=1) + "\n")

    cases = (LEVER_CASES if args.cases == "levers" else ([] if args.no_bench_cases else BENCH_CASES) + CASES)
    for name, lens, h_q, s_q in cases:
        if args.only and args.only not in name:
            continue
        rows_q = s_q * h_q
        cache, table = _compact_cache(lens, device)
        q = torch.randn(len(lens), s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        meta, splits = tilefuse.get_mla_metadata(seqlens, rows_q, 1)

        def attention():
            return tilefuse.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, splits, causal=True)

        entry = {"case": name, "batch": len(lens), "h_q": h_q, "s_q": s_q, "tokens": sum(lens), "max_len": max(lens)}
        default = _with_switch(attention, {})
        ref = default()[0].float()
        runs = {}
        for cand in names:
            runs[cand] = _with_switch(attention, CANDIDATES[cand])
            out = runs[cand]()[0].float()
            entry[f"{cand}_rel_err" if len(names) > 1 else "rel_err"] = float((out - ref).norm() / ref.norm())
        if args.warm:
            torch.cuda.synchronize()
            print(f"[warm] {name}", flush=True)
            del cache, table, q
            continue
        first = timer.graph_us(default)
        for cand in names:
            err = entry[f"{cand}_rel_err" if len(names) > 1 else "rel_err"]
            entry[f"{cand}_us"] = timer.graph_us(runs[cand]) if err < MAX_REL_ERR else None
        last = timer.graph_us(default)
        entry["default_runs_us"] = [first, last]
        entry["default_us"] = (first + last) / 2
        entry["floor_us"] = (sum(lens) * 1152 + q.numel() * 2 + len(lens) * rows_q * 1024) / copy_gbps / 1e3
        for label, module in peers.items():
            p_meta, p_splits = module.get_mla_metadata(seqlens, rows_q, 1)

            def peer(module=module, p_meta=p_meta, p_splits=p_splits):
                return module.flash_mla_with_kvcache(q, cache, table, seqlens, 512, p_meta, p_splits, causal=True)
            try:
                peer()                      # FlashMLA main fills its schedule in its first call
                entry[f"{label}_us"] = timer.graph_us(peer)
            except Exception as exc:        # a peer that refuses a shape: recorded
                entry[f"{label}_error"] = str(exc).splitlines()[0][:200]
        peer_us = [entry[k] for k in entry if k.startswith("flashmla") and k.endswith("_us")]
        if peer_us:
            entry["faster_peer_us"] = min(peer_us)
            entry["default_vs_peer"] = min(peer_us) / entry["default_us"]
            for cand in names:
                if entry[f"{cand}_us"]:
                    entry[f"{cand}_vs_peer"] = min(peer_us) / entry[f"{cand}_us"]
        rows.append(entry)
        shown = ", ".join(f"{cand} {entry[f'{cand}_us'] and round(entry[f'{cand}_us'], 1)} us "
                          f"(x{(entry['default_us'] / entry[f'{cand}_us']) if entry[f'{cand}_us'] else 0:.3f})"
                          for cand in names)
        errs = max(v for k, v in entry.items() if k.endswith("rel_err"))
        print(f"# {name}: default {entry['default_us']:.1f} us ({first:.1f}, {last:.1f}), {shown}, "
              f"peer {entry.get('faster_peer_us', 0):.1f} us, floor {entry['floor_us']:.1f} us, "
              f"rel_err <= {errs:.1e}", flush=True)
        write()
        del cache, table, q
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
