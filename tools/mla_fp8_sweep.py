"""Sweep the Gluon dense FP8 MLA kernel's launch (``configs.FP8_GLUON_CONFIGS``) on a GPU: for each
tile of query rows, every (STAGES, num_warps) that compiles, timed as CUDA-graph replays of
``flash_mla_with_kvcache(..., is_fp8_kvcache=True)`` (cold L2) beside the ``tl`` kernels and the
bf16 decode of the dequantized cache.

    python3 tools/mla_fp8_sweep.py [OUT.json]

Cases: 16 rows (b16 h16 s1 32K, b64 h16 s1 8K), 32 rows (b64 h16 s2 8K, b32 h32 s1 16K) and, past
``configs.FP8_GLUON_MAX_ROWS`` (raised for the run), 48-128 rows on head tiles of 32 (b64 h16 s3 8K,
b32 h64 s1 16K, b64 h32 s2 8K, b16 h128 s1 8K, b64 h128 s1 4K): each launch's output is checked
against the ``tl`` kernels' (relative error), which the default takes there. Below 64 rows both
``tl`` kernels are timed too (``tl_standard_us``, ``tl_transposed_us``).
Writes ``bench/results/sweeps/mla-fp8-<gpu>.json`` by default. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from sweep_common import require_gpu

import tilefuse
from tilefuse.bench.harness import Timer
from tilefuse.bench.mla import fp8_paged_cache
from tilefuse.ops.mla import configs, op

CASES = [(16, 16, 1, 32768), (64, 16, 1, 8192), (64, 16, 2, 8192), (32, 32, 1, 16384),
         (64, 16, 3, 8192), (32, 64, 1, 16384), (64, 32, 2, 8192), (16, 128, 1, 8192), (64, 128, 1, 4096)]
LAUNCHES = {16: [(2, 4), (3, 4), (2, 8), (3, 8)], 32: [(2, 8), (2, 4)]}
MAX_REL_ERR = 2e-2    # e4m3 codes dequantized the same way by both; bf16 outputs, different split sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file")
    args = ap.parse_args()
    require_gpu()
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=30.0)
    shipped = {k: dict(v) for k, v in configs.FP8_GLUON_CONFIGS.items()}
    shipped_max_rows = configs.FP8_GLUON_MAX_ROWS
    rows_out = []
    for batch, h_q, s_q, ctx in CASES:
        rows = s_q * h_q
        block_h = min((b for b in configs.FP8_GLUON_CONFIGS if rows <= b), default=max(configs.FP8_GLUON_CONFIGS))
        configs.FP8_GLUON_MAX_ROWS = max(shipped_max_rows, rows)
        k_cache, block_table = fp8_paged_cache([ctx] * batch, device)
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        meta, splits = tilefuse.get_mla_metadata(lens, rows, 1)

        def call():
            return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                                   is_fp8_kvcache=True)

        tl_variant = configs.default_variant(rows, block_table.shape[1], False, op._chip_ridge(q))
        with tilefuse.force(variant=tl_variant):
            tl_meta, tl_splits = tilefuse.get_mla_metadata(lens, rows, 1)

            def tl_call():
                return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, tl_meta, tl_splits,
                                                       causal=True, is_fp8_kvcache=True)
            tl_out = tl_call()[0].float()
        entry = {"batch": batch, "h_q": h_q, "s_q": s_q, "context": ctx, "tl_variant": tl_variant, "launches": {},
                 "rel_err": {}}
        for stages, warps in LAUNCHES[block_h]:
            configs.FP8_GLUON_CONFIGS[block_h] = dict(BLOCK_H=block_h, STAGES=stages, num_warps=warps)
            configs.launch_config.cache_clear()
            op._plans.clear()
            name = f"stages {stages}, warps {warps}"
            try:
                err = float((call()[0].float() - tl_out).norm() / tl_out.norm())
                entry["rel_err"][name] = err
                us = timer.graph_us(call) if err < MAX_REL_ERR else None
            except Exception as exc:          # a launch that does not compile or fit: recorded
                us = None
                entry.setdefault("errors", {})[f"{stages}x{warps}"] = str(exc).splitlines()[0][:200]
            entry["launches"][name] = us
        configs.FP8_GLUON_CONFIGS.update({k: dict(v) for k, v in shipped.items()})
        configs.FP8_GLUON_MAX_ROWS = shipped_max_rows
        configs.launch_config.cache_clear()
        op._plans.clear()
        with tilefuse.force(variant=tl_variant):
            entry["tl_us"] = timer.graph_us(tl_call)
        if rows < 64:     # both tl kernels below 64 rows (standard: padded to a 64-row tile there)
            for variant in ("standard", "transposed"):
                with tilefuse.force(variant=variant):
                    v_meta, v_splits = tilefuse.get_mla_metadata(lens, rows, 1)
                    entry[f"tl_{variant}_us"] = timer.graph_us(lambda: tilefuse.flash_mla_with_kvcache(
                        q, k_cache, block_table, lens, 512, v_meta, v_splits, causal=True, is_fp8_kvcache=True))
        bf16 = tilefuse.mla_dequantize_kv(k_cache, torch.bfloat16)
        entry["bf16_us"] = timer.graph_us(lambda: tilefuse.flash_mla_with_kvcache(
            q, bf16, block_table, lens, 512, meta, splits, causal=True))
        rows_out.append(entry)
        print(entry, flush=True)
        del k_cache, bf16
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device).replace(" ", "-").lower()
    path = args.out or Path(f"bench/results/sweeps/mla-fp8-{gpu}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d")}
    path.write_text(json.dumps({"machine": machine, "shipped": shipped, "shipped_max_rows": shipped_max_rows,
                                "rows": rows_out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
