"""A/B of the Gluon dense FP8 MLA kernel's forms on a GPU, in one run: the 64-row tiles
(``wide``, ``configs.FP8_GLUON_WIDE``), the serial form (``configs.FP8_GLUON_SERIAL``), the
warp-specialized one (``configs.FP8_GLUON_WS``) and variants of
it (converter warps, ring slot size), beside the ``tl`` FP8 kernels, the bf16 decode of the
dequantized cache and the copy bandwidth measured now. Each launch is timed as CUDA-graph
replays of ``flash_mla_with_kvcache(..., is_fp8_kvcache=True)`` (cold L2); its output is checked
against the ``tl`` kernel's (relative error) before it is timed.

    python3 tools/mla_fp8_sweep.py [OUT.json] [--cases issue|a47|all] [--forms ws,rs,...] [--no-tl]
                                   [--accuracy] [--no-ablate | --ablate A,B] [--warm --shard I/N]

``--warm`` runs every launch of the cases ``i % N == I`` once, untimed and unwritten: processes
started side by side fill Triton's cache (each case's shapes compile kernels of their own), so
that the timed run after them spends its time timing (``tools/mla_fp8_gpu_check.sh``).

Cases: uniform and uneven lengths (4K-128K), batch 16-128, 8-128 heads, s_q 1-4 (8-128 query
rows); past 32 rows the forms run as head tiles of 32 (``configs.FP8_GLUON_MAX_ROWS`` raised for
the run where it is lower), beside the ``tl`` standard kernel. ``--cases a47``: the dense cases of
the FP8 decode's targets (b32 h16 s_q 1 16K, b64 h16 s_q 2 8K, b16 h128 s_q 1 32K) and a held-out
uneven batch. ``--accuracy``: each form's output and the bf16 path's against the fp64 reference on
the dequantized cache (cos_diff, largest absolute error), beside the timings. Per case: each form's graph_us, the bytes read
(the FP8 rows of every request, q, out), their rate against the copy bandwidth, and the speed-up
over the bf16 path. On three cases the warp-specialized form also runs with stages left out
(``SKIP``: timing only), which shows which partition bounds it. Writes
``bench/results/sweeps/mla-fp8-ws-<gpu>.json`` by default. Needs a CUDA GPU.
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
from tilefuse.bench.harness import Timer
from tilefuse.bench.mla import fp8_paged_cache
from tilefuse.ops.mla import configs, op
from tilefuse.ops.mla.reference import FP8_KV_BYTES, mla_decode_reference
from tilefuse.testing.compare import cos_diff


def _uneven(batch: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(batch)]


# (name, lengths, h_q, s_q): the issue's cases, then held-out ones (uneven b48 h24 up to 60K, b96 4K)
CASES = [
    ("b32 h16 s1 16K", [16384] * 32, 16, 1),
    ("b64 h16 s2 8K", [8192] * 64, 16, 2),
    ("b16 h16 s1 32K", [32768] * 16, 16, 1),
    ("b32 h32 s1 16K", [16384] * 32, 32, 1),
    ("b128 h8 s4 16K", [16384] * 128, 8, 4),
    ("b16 h8 s1 128K", [131072] * 16, 8, 1),
    ("b64 h16 s1 uneven 4K-128K", _uneven(64, 4096, 131072, 1), 16, 1),
    ("b128 h32 s1 uneven 4K-16K", _uneven(128, 4096, 16384, 2), 32, 1),
    ("held-out b48 h24 s1 uneven 1K-60K", _uneven(48, 1024, 61440, 3), 24, 1),
    ("held-out b96 h16 s1 4K", [4096] * 96, 16, 1),
    ("b64 h16 s3 8K (48 rows)", [8192] * 64, 16, 3),
    ("b32 h32 s2 16K (64 rows)", [16384] * 32, 32, 2),
    ("b16 h128 s1 32K (128 rows)", [32768] * 16, 128, 1),
    ("b64 h128 s1 8K (128 rows)", [8192] * 64, 128, 1),
    ("held-out b24 h64 s2 uneven 2K-40K (128 rows)", _uneven(24, 2048, 40960, 5), 64, 2),
    ("held-out b32 h128 s1 uneven 1K-20K (128 rows)", _uneven(32, 1024, 20480, 6), 128, 1),
    ("held-out b40 h16 s1 uneven 2K-48K", _uneven(40, 2048, 49152, 4), 16, 1),
]
ISSUE = {"b32 h16 s1 16K", "b64 h16 s2 8K"}
A47 = ["b32 h16 s1 16K", "b64 h16 s2 8K", "b16 h128 s1 32K (128 rows)", "held-out b40 h16 s1 uneven 2K-48K",
       "b64 h128 s1 8K (128 rows)", "held-out b24 h64 s2 uneven 2K-40K (128 rows)",
       "held-out b32 h128 s1 uneven 1K-20K (128 rows)", "b32 h32 s2 16K (64 rows)"]


# The 64-row tiles of kernels_gluon_fp8_wide (the 16-bit kernel's warpgroups and a converter
# warpgroup): run at every row count of a case (configs.FP8_WIDE_FROM_ROWS lowered to 1), the
# other forms with it out of the way. Their launches are configs.FP8_GLUON_WIDE with these
# overrides (the L2 prefetch distance in tiles), not FP8_GLUON_CONFIGS.
WIDE_FORMS = {"wide": {}, "wide-p0": dict(PREFETCH=0), "wide-p2": dict(PREFETCH=2),
              "wide-pipe": dict(PIPELINE=1), "wide-pipe-p0": dict(PIPELINE=1, PREFETCH=0),
              # stages left out (timing only, outputs not checked): the converter's conversion and
              # stores, its loads, both (what remains: the MMA warpgroups and the hand-offs)
              "wide-skip-convert": dict(SKIP=1), "wide-skip-load": dict(SKIP=2), "wide-skip-both": dict(SKIP=3)}


def _forms() -> dict[str, dict[int, dict]]:
    ws = configs.FP8_GLUON_WS
    return {
        **{name: ws for name in WIDE_FORMS},
        "serial": configs.FP8_GLUON_SERIAL,
        "ws": ws,
        "ws-conv4": {k: dict(v, CONVERTERS=4) for k, v in ws.items()},
        "ws-ahead": {k: dict(v, MMA_AHEAD=1) for k, v in ws.items()},
        "rs": configs.FP8_GLUON_RS,
        "rs-s3": {k: dict(v, STAGES=3) for k, v in configs.FP8_GLUON_RS.items()},
        "rs2": configs.FP8_GLUON_RS2,
    }


# The warp-specialized form with stages left out (timing only, outputs not checked): what the
# producer and the converters take without the products (skip-mma), the producer and the
# products without the conversion (skip-convert), the producer alone (skip-both: the TMA ring);
# the register-operand form without S^T (rs-skip-qk), without P V (rs-skip-pv), its producer
# alone (rs-skip-both: its deeper ring of 64-token slots).
ABLATIONS = {"ws-skip-convert": ("FP8_GLUON_WS", 1), "ws-skip-mma": ("FP8_GLUON_WS", 2),
             "ws-skip-both": ("FP8_GLUON_WS", 3), "rs-skip-qk": ("FP8_GLUON_RS", 1),
             "rs-skip-pv": ("FP8_GLUON_RS", 2), "rs-skip-both": ("FP8_GLUON_RS", 3)}
ABLATED = {"b32 h16 s1 16K", "b32 h32 s1 16K", "b16 h8 s1 128K"}


MAX_REL_ERR = 2e-2    # e4m3 codes dequantized alike; bf16 outputs, different split sums


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """cos_diff and the largest absolute error of ``out`` against the fp64 reference ``ref``."""
    return {"cos_diff": cos_diff(out, ref), "max_abs": float((out.double() - ref).abs().max())}


def _reset() -> None:
    configs.launch_config.cache_clear()
    op._plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file")
    ap.add_argument("--cases", choices=["issue", "a47", "all"], default="all")
    ap.add_argument("--forms", default="", help="comma-separated forms to run (default: all)")
    ap.add_argument("--no-tl", action="store_true", help="leave out the tl kernels")
    ap.add_argument("--no-ablate", action="store_true", help="leave out the stage ablations")
    ap.add_argument("--ablate", default="", help="comma-separated ablations to run (default: all)")
    ap.add_argument("--accuracy", action="store_true", help="errors against the fp64 reference")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="graph replays per timing, in ms")
    ap.add_argument("--warm", action="store_true", help="run each launch once, untimed; write nothing")
    ap.add_argument("--shard", default="0/1", help="I/N: only the cases i %% N == I")
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    args = ap.parse_args()
    shard, shards = (int(v) for v in args.shard.split("/"))
    require_gpu()
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=args.rep_ms)
    if args.warm:      # one call each, for the compiles: nothing is timed
        timer.graph_us = lambda fn: (fn(), torch.cuda.synchronize(), 1.0)[-1]
        timer.gpu_us = timer.graph_us
    shipped = {k: dict(v) for k, v in configs.FP8_GLUON_CONFIGS.items()}
    shipped_max_rows = configs.FP8_GLUON_MAX_ROWS
    shipped_wide_from = configs.FP8_WIDE_FROM_ROWS
    shipped_wide = dict(configs.FP8_GLUON_WIDE)
    # copy bandwidth now (read + write of 1 GiB each way), the floor's rate
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 2 / timer.gpu_us(lambda: dst.copy_(src)) / 1e3
    del src, dst
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows_out = []
    gpu = torch.cuda.get_device_name(device).replace(" ", "-").lower()
    path = args.out or Path(f"bench/results/sweeps/mla-fp8-ws-{gpu}.json")
    machine = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d")}

    def write():         # after every case: a run cut short keeps what it measured
        if args.warm:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine, "copy_gbps": copy_gbps, "forms": _forms(), "shipped": shipped,
                                    "shipped_max_rows": shipped_max_rows, "rows": rows_out}, indent=1))
    chosen = [c for c in CASES if (args.cases == "all" or c[0] in (ISSUE if args.cases == "issue" else A47))
              and args.only in c[0]]
    wanted = [f for f in args.forms.split(",") if f]
    for i, (name, lens, h_q, s_q) in enumerate(chosen):
        if i % shards != shard:
            continue
        rows = s_q * h_q
        batch = len(lens)
        k_cache, block_table = fp8_paged_cache(lens, device)
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        meta, splits = tilefuse.get_mla_metadata(seqlens, rows, 1)
        nbytes = sum(lens) * FP8_KV_BYTES + q.numel() * 2 + batch * rows * 512 * 2

        def call():
            return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits, causal=True,
                                                   is_fp8_kvcache=True)

        tl_variant = "standard" if rows > configs.FP8_TRANSPOSED_MAX_ROWS else configs.default_variant(
            rows, block_table.shape[1], False, op._chip_ridge(q))
        ref = None
        if args.accuracy and not args.warm:      # the fp64 spec on the dequantized cache
            ref = mla_decode_reference(q, k_cache, block_table, seqlens, 512, causal=True,
                                       compute_dtype=torch.float64)[0]
        with tilefuse.force(variant=tl_variant):
            tl_meta, tl_splits = tilefuse.get_mla_metadata(seqlens, rows, 1)

            def tl_call():
                return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tl_meta, tl_splits,
                                                       causal=True, is_fp8_kvcache=True)
            tl_out = tl_call()[0].float()
            # (timed where it is the default: past the Gluon FP8 kernel's rows)
            tl_us = None if args.no_tl and rows <= shipped_max_rows else timer.graph_us(tl_call)
        entry = {"case": name, "batch": batch, "h_q": h_q, "s_q": s_q, "rows": rows, "tokens": sum(lens),
                 "max_len": max(lens), "bytes": nbytes, "tl_variant": tl_variant, "tl_us": tl_us, "forms": {},
                 "rel_err": {}}
        if ref is not None:
            entry["accuracy"] = {"tl": _errors(tl_out, ref)}
        configs.FP8_GLUON_MAX_ROWS = max(shipped_max_rows, rows)
        forms = {f: c for f, c in _forms().items() if not wanted or f in wanted}
        if name in ABLATED and not args.no_ablate:
            ablate = [a for a in args.ablate.split(",") if a] or list(ABLATIONS)
            forms.update({a: {r: dict(c, SKIP=ABLATIONS[a][1]) for r, c in getattr(configs, ABLATIONS[a][0]).items()}
                          for a in ablate})
        for form, cfgs in forms.items():
            configs.FP8_GLUON_CONFIGS.clear()
            configs.FP8_GLUON_CONFIGS.update({k: dict(v) for k, v in cfgs.items()})
            configs.FP8_WIDE_FROM_ROWS = 1 if form in WIDE_FORMS else 1 << 30
            configs.FP8_GLUON_WIDE = dict(shipped_wide, **WIDE_FORMS.get(form, {}))
            _reset()
            try:
                out = call()[0].float()
                err = float((out - tl_out).norm() / tl_out.norm())
                entry["rel_err"][form] = err
                if ref is not None and "-skip-" not in form:
                    entry["accuracy"][form] = _errors(out, ref)
                del out
                ablated = "-skip-" in form
                us = timer.graph_us(call) if err < MAX_REL_ERR or ablated else None
            except Exception as exc:          # a launch that does not compile or fit: recorded
                us = None
                entry.setdefault("errors", {})[form] = str(exc).splitlines()[0][:300]
            entry["forms"][form] = us
        configs.FP8_GLUON_CONFIGS.clear()
        configs.FP8_GLUON_CONFIGS.update(shipped)
        configs.FP8_GLUON_MAX_ROWS = shipped_max_rows
        configs.FP8_WIDE_FROM_ROWS = shipped_wide_from
        configs.FP8_GLUON_WIDE = shipped_wide
        _reset()
        bf16 = tilefuse.mla_dequantize_kv(k_cache, torch.bfloat16)

        def bf16_call():
            return tilefuse.flash_mla_with_kvcache(q, bf16, block_table, seqlens, 512, meta, splits, causal=True)
        try:
            if ref is not None:
                entry["accuracy"]["bf16 path"] = _errors(bf16_call()[0].float(), ref)
            entry["bf16_us"] = timer.graph_us(bf16_call)
        except Exception as exc:              # recorded: the FP8 forms' timings stand without it
            entry["bf16_us"] = None
            entry.setdefault("errors", {})["bf16 path"] = str(exc).splitlines()[0][:300]
        del bf16, ref
        timed = {f: us for f, us in entry["forms"].items() if us and "-skip-" not in f}
        best = min(timed, key=timed.get) if timed else None
        entry["best"] = best
        entry["floor_us"] = nbytes / copy_gbps / 1e3
        if best:
            entry["best_copy_frac"] = entry["floor_us"] / timed[best]
            entry["best_vs_bf16"] = entry["bf16_us"] / timed[best] if entry["bf16_us"] else None
            entry["best_vs_serial"] = (entry["forms"].get("serial") or float("nan")) / timed[best]
            entry["best_vs_tl"] = tl_us / timed[best] if tl_us else None
        rows_out.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k not in ("rel_err",)}), flush=True)
        forms_us = " ".join(f"{f} {us:.1f}" if us else f"{f} -" for f, us in entry["forms"].items())
        print(f"# {name}: {forms_us} | tl {tl_us or 0:.1f} bf16 {entry['bf16_us'] or 0:.1f} floor {entry['floor_us']:.1f} us; "
              f"best {best}: x{entry.get('best_vs_bf16') or 0:.2f} bf16, x{entry.get('best_vs_serial', 0):.2f} serial, "
              f"{entry.get('best_copy_frac', 0):.2f} of copy bw", flush=True)
        write()
        del k_cache, block_table
        torch.cuda.empty_cache()
    if not args.warm:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
