"""The end-to-end part of ``tilefuse bench tp`` (:mod:`tilefuse.bench.tp`): greedy decoding of a
Llama-3-8B-shaped model at TP=1 and TP=N, ms per token from the decode steps' own times (none on a
CPU: the pipeline check) and the tokens' agreement with TP=1 stock."""

from __future__ import annotations

import statistics
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tilefuse.bench.tp_common import Plan, gather_rows, log


def e2e_rows(plan: Plan, device, dtype, world: int, cpu: bool) -> list[dict]:
    """Greedy decode ms/token of a Llama-3-8B-shaped model: TP=1 stock / fused, TP=world through
    shard_model (dense / fused) and transformers' tp_plan (stock / tilefuse.parallel.hf.patch_swiglu)."""
    import importlib.util

    import tilefuse.hf
    from tilefuse.bench.hf_decode import Clock, GraphDecoder
    from tilefuse.bench.hf_models import llama3_8b_config, random_model, tiny_llama_config
    from tilefuse.parallel import shard_model

    config = tiny_llama_config(plan.e2e_layers) if cpu else llama3_8b_config(plan.e2e_layers)
    rows, tokens = [], {}

    def measure(name: str, tp: int, make: Callable[[], nn.Module]) -> None:
        model = make()
        for batch in plan.e2e_batches:
            gen = torch.Generator(device="cpu").manual_seed(7)
            prompt = torch.randint(0, config.vocab_size, (batch, plan.e2e_prompt), generator=gen).to(device)
            for mode in ("graph", "eager") if not cpu else ("eager",):
                row = {"family": "tp", "kind": "e2e", "tp": tp, "impl": name, "mode": mode,
                       "params": {"model": "llama3-8b-shapes" if not cpu else "tiny-llama", "layers": plan.e2e_layers,
                                  "batch": batch}}
                try:   # every rank fails alike (same model, same step), so none is left in a collective
                    clock = Clock(device, plan.e2e_tokens) if not cpu else None
                    decoder = GraphDecoder(model, batch, plan.e2e_prompt + plan.e2e_tokens, capture=mode == "graph")
                    with torch.no_grad():
                        ids = decoder.decode(prompt, plan.e2e_tokens, clock)
                    steps = clock.intervals_ms()[min(4, plan.e2e_tokens // 4):] if clock else []
                except Exception as exc:  # noqa: BLE001 -- recorded; the other routes still run
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    log(f"e2e {name} tp={tp} batch={batch} {mode}: {rows[-1]['error']}")
                    continue
                if steps:
                    local = {"ms_per_token": statistics.median(steps)}
                    per_rank = gather_rows(local, world) if tp > 1 else [local]
                    row["ms_per_token"] = round(max(r["ms_per_token"] for r in per_rank), 4)
                    row["rank_ms_per_token"] = [round(r["ms_per_token"], 4) for r in per_rank]
                base = tokens.setdefault((batch, mode), ids.cpu())
                row["agreement_vs_tp1_stock"] = round(float((ids.cpu() == base).float().mean()), 4)
                rows.append(row)
                log(f"e2e {name} tp={tp} batch={batch} {mode}: "
                    + (f"{row['ms_per_token']:.3f} ms/token" if steps else "ran"))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def fused(model):
        tilefuse.hf.patch_swiglu(model)
        return model

    def sharded(model, fuse: bool):
        if fuse:
            tilefuse.hf.patch_swiglu(model)
        shard_model(model)
        return model

    measure("stock", 1, lambda: random_model(config, device, dtype))
    measure("tilefuse-swiglu", 1, lambda: fused(random_model(config, device, dtype)))
    if world > 1:
        measure("shard_model", world, lambda: sharded(random_model(config, device, dtype), False))
        measure("shard_model+swiglu", world, lambda: sharded(random_model(config, device, dtype), True))
        if importlib.util.find_spec("accelerate") is not None:
            tp_plan_rows(config, device, dtype, world, measure)
        else:
            log("accelerate is not installed: transformers' tp_plan route skipped")
    return rows


def tp_plan_rows(config, device, dtype, world, measure) -> None:
    """transformers' tp_plan="auto" from a checkpoint rank 0 writes: stock, and patched by tilefuse."""
    import shutil

    from transformers import AutoModelForCausalLM

    from tilefuse.bench.hf_models import random_model
    from tilefuse.parallel.hf import patch_swiglu

    folder = [tempfile.mkdtemp(prefix="tilefuse-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if dist.get_rank() == 0:
        random_model(config, device, dtype).save_pretrained(folder[0])
    dist.barrier()

    def load(patch: bool):
        model = AutoModelForCausalLM.from_pretrained(folder[0], tp_plan="auto", dtype=dtype).eval()
        if patch:
            patch_swiglu(model)
        return model

    try:
        measure("tp_plan", world, lambda: load(False))
        measure("tp_plan+parallel.hf.patch_swiglu", world, lambda: load(True))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
