"""Same-run A/B of the Gluon MLA kernel's transposed form (``kernels_gluon_t``, up to 32 query rows)
against its 64-row head tiles (the default) on tilefuse bench mla's cases of <= 32 query rows and
on batches the benchmark does not hold: uneven, Zipf-distributed and one-long-many-short lengths,
s_q 1-4, 1-32 query rows per KV head. Each
is the attention call alone (its metadata computed once, as a model runs every layer after one
metadata call), timed as CUDA-graph replays (cold L2, do_bench median), with the FlashMLA builds
named in ``TILEFUSE_FLASHMLA`` (``tilefuse.bench.mla.flashmla_peers``) timed the same way beside
it; the transposed form's output is checked against the default's first (relative error).

    python3 tools/mla_wgmma_t_ab.py [OUT.json] [--rep-ms MS] [--no-bench-cases]

Writes ``bench/results/sweeps/mla-wgmma-t-<gpu>.json`` by default (after every case: a run cut
short keeps what it measured). Needs a CUDA GPU (Hopper for the Gluon kernels).
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


def _with_switch(attention, max_rows: int):
    def run():
        saved, configs.TRANSPOSED_GLUON_MAX_ROWS = configs.TRANSPOSED_GLUON_MAX_ROWS, max_rows
        try:
            return attention()
        finally:
            configs.TRANSPOSED_GLUON_MAX_ROWS = saved
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file")
    ap.add_argument("--rep-ms", type=float, default=20.0, help="do_bench window per measurement (ms)")
    ap.add_argument("--no-bench-cases", action="store_true", help="the held-out batches only")
    args = ap.parse_args()
    require_gpu()
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=args.rep_ms)
    gpu = torch.cuda.get_device_name(device)
    path = args.out or Path(f"bench/results/sweeps/mla-wgmma-t-{gpu.replace(' ', '-').lower()}.json")
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 2 / timer.gpu_us(lambda: dst.copy_(src)) / 1e3
    del src, dst
    peers = flashmla_peers()
    machine = {"gpu": gpu, "torch": torch.__version__, "triton": __import__("triton").__version__,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "peers": sorted(peers)}
    print(f"{gpu}: copy bandwidth {copy_gbps:.0f} GB/s, peers {sorted(peers)}", flush=True)
    rows: list[dict] = []

    def write():
        path.parent.mkdir(parents=True, exist_ok=True)
        ratios = [r["default_us"] / r["wgmma_t_us"] for r in rows if r.get("wgmma_t_us")]
        summary = {"speedup_geomean": geomean(ratios), "faster_in": sum(x > 1 for x in ratios), "of": len(ratios)}
        path.write_text(json.dumps({"machine": machine, "copy_gbps": copy_gbps, "timing": (
            "attention alone (metadata once), CUDA-graph replay, cold L2, do_bench median over rep_ms"),
            "rep_ms": args.rep_ms, "summary": summary, "rows": rows}, indent=1) + "\n")

    for name, lens, h_q, s_q in ([] if args.no_bench_cases else BENCH_CASES) + CASES:
        rows_q = s_q * h_q
        cache, table = _compact_cache(lens, device)
        q = torch.randn(len(lens), s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        meta, splits = tilefuse.get_mla_metadata(seqlens, rows_q, 1)

        def attention():
            return tilefuse.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, splits, causal=True)

        entry = {"case": name, "batch": len(lens), "h_q": h_q, "s_q": s_q, "tokens": sum(lens), "max_len": max(lens)}
        default, transposed = _with_switch(attention, 0), _with_switch(attention, 32)
        ref = default()[0].float()
        out = transposed()[0].float()
        entry["rel_err"] = float((out - ref).norm() / ref.norm())
        entry["default_us"] = timer.graph_us(default)
        entry["wgmma_t_us"] = timer.graph_us(transposed) if entry["rel_err"] < MAX_REL_ERR else None
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
            if entry["wgmma_t_us"]:
                entry["wgmma_t_vs_peer"] = min(peer_us) / entry["wgmma_t_us"]
        rows.append(entry)
        t_us = entry["wgmma_t_us"]
        print(f"# {name}: default {entry['default_us']:.1f} us, wgmma-t {t_us and round(t_us, 1)} us "
              f"(x{(entry['default_us'] / t_us) if t_us else 0:.3f}), peer {entry.get('faster_peer_us', 0):.1f} us, "
              f"floor {entry['floor_us']:.1f} us, rel_err {entry['rel_err']:.1e}", flush=True)
        write()
        del cache, table, q
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
