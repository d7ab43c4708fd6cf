"""The DeepSeek part of ``tilefuse bench tp``: greedy decoding of a DeepSeek-V3-shaped model
through :func:`tilefuse.hf.patch_mla` at every tensor-parallel degree the launch allows.

Model: DeepSeek-V3's shapes (:func:`tilefuse.bench.hf_models.deepseek_v3_config`: hidden 7168,
MLA with 128 heads, q LoRA 1536, KV LoRA 512, every block a dense 18432 SwiGLU MLP, vocab 129280),
8 blocks (``--layers``), random weights from one seed, bf16, the MLPs fused
(:func:`tilefuse.hf.patch_swiglu`) at every degree. At TP=d it is cut by
:func:`tilefuse.parallel.shard_model` (``128 / d`` heads per rank: ``q_b_proj`` and ``kv_b_proj``
by rows, ``o_proj`` row-parallel; the MLP a :class:`~tilefuse.parallel.ParallelSwiGLUMLP`;
``lm_head`` cut by the vocabulary, its logits all-gathered), then patched by ``patch_mla``; each
rank holds a :class:`tilefuse.hf.PagedMLACache` of the whole latent.

Degrees: 1, then every power of two up to the launch's world size (``torchrun --nproc-per-node
8``: 1, 2, 4, 8). At degree d the ranks form ``world / d`` groups of d (``new_subgroups``) that
decode the same batch at the same time, so every GPU is busy in every measurement, as at TP=1,
where each rank decodes alone.

Context: the cache is filled with ``context`` random latents per request (one seed: the same on
every rank and degree), then a short prompt is prefilled after them and ``tokens`` new tokens are
decoded: each decode step attends over ``context + prompt + i`` latents, the cost of a
``context``-token conversation without its prefill (a 16 x 32K prefill through the expanded
attention would not fit one GPU). Positions count from the prompt's start; RoPE does not change
the cost.

Per (degree, attention, mode): ms per token (the median interval between new tokens on the
device's timeline, the first few left out; the slowest rank), ``graph`` (the decode step captured
in a CUDA graph and replayed, :class:`tilefuse.hf.decode.Generator`) and ``eager``; the greedy
tokens against TP=1's (the same attention and mode): equal or not, where they first part, the
fraction equal; and the logits of one decode step over the context against TP=1's (relative
Frobenius error). Attention: ``tilefuse`` (``tilefuse.flash_mla_with_kvcache``) and, where the
``flash_mla`` package is built, ``flashmla`` (``patch_mla(attention=flash_mla)``), each against
its own TP=1.

Goals: the same greedy tokens as TP=1 over the decoded tokens; logits within bf16 rounding of
TP=1's (relative error <= 4u + 2^-16, u = 2^-8: the bound of one layer in
:mod:`tilefuse.testing.parallel`); decode step at TP=2 <= 0.6 x TP=1 and at TP=8 <= 0.2 x TP=1,
batch 16, 32K context, CUDA graph. Random weights leave near-ties among the logits, so two runs
that differ by a rounding may part at a near-tie; the logits' error says whether they differ by
more.

Without a GPU (gloo, the tiny DeepSeek of the CPU pipeline check): the same route, nothing timed.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tilefuse.bench.tp_common import gather_rows, log

TP2_GOAL, TP8_GOAL = 0.6, 0.2
KIND = "deepseek-decode"          # the rows' kind, and `--only deepseek-decode` runs this part alone


@dataclass(frozen=True)
class DeepSeekPlan:
    layers: int
    batch: int
    context: int
    prompt: int
    tokens: int
    skip: int                    # decode intervals left out as warm-up


GPU_PLAN = DeepSeekPlan(8, 16, 32768, 16, 64, 4)
GPU_QUICK_PLAN = DeepSeekPlan(8, 16, 32768, 16, 32, 4)
CPU_PLAN = DeepSeekPlan(2, 2, 80, 4, 6, 0)


def plan_for(quick: bool, cuda: bool, layers: int | None = None) -> DeepSeekPlan:
    """The plan of a run: GPU (``--quick``: half the decoded tokens) or the CPU pipeline check;
    ``layers`` (``--layers``) replaces the block count."""
    plan = (GPU_QUICK_PLAN if quick else GPU_PLAN) if cuda else CPU_PLAN
    return replace(plan, layers=layers) if layers else plan


def degrees(world: int) -> list[int]:
    """1, then the powers of two up to ``world`` that divide it."""
    out, d = [1], 2
    while d <= world:
        if world % d == 0:
            out.append(d)
        d *= 2
    return out


def flash_mla_module():
    """The built ``flash_mla`` package, or None."""
    try:
        import flash_mla
    except Exception:  # noqa: BLE001 -- not built, or built for another torch: no such rows
        return None
    return flash_mla


def context_cache(model, batch: int, max_tokens: int, context: int, seed: int = 7):
    """A :class:`tilefuse.hf.PagedMLACache` of ``context + max_tokens`` tokens per request whose
    first ``context`` rows hold random latents (``seed``: the same on every rank) and which
    :meth:`reset` leaves holding them: the next forward (the prompt's prefill) writes after them
    and the decode steps attend over them."""
    from tilefuse.hf.mla import PagedMLACache

    class ContextCache(PagedMLACache):
        def reset(self) -> None:
            super().reset()
            self.cache_seqlens.fill_(context)

    cache = ContextCache(model, max_batch=batch, max_tokens=context + max_tokens)
    gen = torch.Generator(device=cache.latent_pages.device).manual_seed(seed)
    cache.latent_pages.normal_(generator=gen)       # O(1), as kv_a_layernorm's output and the RoPE'd k_pe
    cache.reset()
    return cache


def build(config, device, dtype, group, attention) -> torch.nn.Module:
    """The model at this rank's degree, its MLPs fused: full (group None) or cut by shard_model
    over ``group`` (``lm_head`` by the vocabulary too), then patched by patch_mla with ``attention``."""
    from tilefuse.bench.hf_models import random_model
    from tilefuse.hf import patch_mla, patch_swiglu
    from tilefuse.parallel import shard_model

    model = random_model(config, device, dtype)
    patch_swiglu(model)
    if group is not None:
        shard_model(model, group, lm_head=True)
    patch_mla(model, attention=attention)
    return model


@torch.no_grad()
def decode(model, plan: DeepSeekPlan, prompt: torch.Tensor, capture: bool, device) -> tuple[torch.Tensor, list]:
    """Greedy tokens ``[batch, tokens]`` after the context and the prompt, and the decode steps'
    intervals in ms (none on a CPU)."""
    from tilefuse.bench.hf_decode import Clock
    from tilefuse.hf.decode import Generator

    room = plan.prompt + max(plan.tokens, Generator.WARMUP_STEPS + 1)
    gen = Generator(model, plan.batch, room, capture=capture)
    gen.cache = context_cache(model, plan.batch, room, plan.context)
    clock = Clock(device, plan.tokens) if device.type == "cuda" else None
    out = gen.run(prompt, None, plan.tokens, on_token=clock.mark if clock else None)
    steps = clock.intervals_ms()[plan.skip:] if clock else []
    return out[:, plan.prompt:].cpu(), steps


@torch.no_grad()
def probe_logits(model, plan: DeepSeekPlan, prompt: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[batch, vocab]`` of one decode step (``token``) over the context and the prompt."""
    from tilefuse.hf.decode import cache_argument

    cache = context_cache(model, plan.batch, plan.prompt + 1, plan.context)
    arg, b = cache_argument(model), prompt.shape[0]
    positions = torch.arange(plan.prompt, device=prompt.device)[None].expand(b, -1)
    model(input_ids=prompt, position_ids=positions, use_cache=True, logits_to_keep=1, **{arg: cache})
    step = torch.full((b, 1), plan.prompt, dtype=torch.long, device=prompt.device)
    logits = model(input_ids=token, position_ids=step, use_cache=True, logits_to_keep=1, **{arg: cache}).logits
    return logits[:, -1].float().cpu()


def _agreement(tokens: torch.Tensor, base: torch.Tensor) -> dict:
    same = tokens == base
    parted = (~same).any(0)
    return {"tokens_equal_tp1": bool(same.all()), "agreement_vs_tp1": round(float(same.float().mean()), 4),
            "first_difference": int(parted.float().argmax()) if bool(parted.any()) else None}


def deepseek_rows(plan: DeepSeekPlan, device, dtype, world: int, cpu: bool, attention_impls=None) -> list[dict]:
    """Every (degree, attention, mode) row of this launch (module docstring), merged over the ranks
    (on every rank; rank 0 writes them)."""
    from tilefuse.bench.hf_models import deepseek_v3_config, tiny_deepseek_config

    config = tiny_deepseek_config(plan.layers) if cpu else deepseek_v3_config(plan.layers, 128)
    if attention_impls is None:
        attention_impls = {"tilefuse": None}
        if not cpu and flash_mla_module() is not None:
            attention_impls["flashmla"] = flash_mla_module()
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, config.vocab_size, (plan.batch, plan.prompt), generator=gen).to(device)
    probe = torch.randint(3, config.vocab_size, (plan.batch, 1), generator=gen).to(device)
    modes = ("eager",) if cpu else ("graph", "eager")
    local: list[dict] = []
    base_tokens: dict = {}
    base_logits: dict = {}
    for degree in degrees(world):
        if degree == 1:
            group = None
        elif degree == world:
            group = dist.group.WORLD
        else:
            group, _ = dist.new_subgroups(group_size=degree)
        for name, attention in attention_impls.items():
            params = {"model": "tiny-deepseek" if cpu else "deepseek-v3-shapes", "layers": plan.layers,
                      "heads": config.num_attention_heads, "batch": plan.batch, "context": plan.context,
                      "tokens": plan.tokens}
            head = {"family": "tp", "kind": KIND, "tp": degree, "impl": name, "params": params}
            try:   # every rank fails alike (same model, same step), so none is left in a collective
                model = build(config, device, dtype, group, attention)
                logits = probe_logits(model, plan, prompt, probe)
            except Exception as exc:  # noqa: BLE001 -- recorded; the other rows still run
                local.append({**head, "mode": "build", "error": f"{type(exc).__name__}: {exc}"[:300]})
                log(f"deepseek tp={degree} {name}: {local[-1]['error']}")
                continue
            ref = base_logits.setdefault(name, logits)
            rel = float((logits - ref).norm() / ref.norm())
            for mode in modes:
                row = {**head, "mode": mode, "logits_rel_err_vs_tp1": round(rel, 7)}
                try:
                    tokens, steps = decode(model, plan, prompt, mode == "graph", device)
                except Exception as exc:  # noqa: BLE001
                    local.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    log(f"deepseek tp={degree} {name} {mode}: {local[-1]['error']}")
                    continue
                if steps:
                    row["ms_per_token"] = statistics.median(steps)
                row.update(_agreement(tokens, base_tokens.setdefault((name, mode), tokens)))
                local.append(row)
                timed = f"{row['ms_per_token']:.3f} ms/token" if steps else "ran"
                log(f"deepseek tp={degree} {name} {mode}: {timed}, tokens equal to TP=1: {row['tokens_equal_tp1']}, "
                    f"logits rel err {rel:.2e}")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return merge_ranks(local, world)


def merge_ranks(local: list[dict], world: int) -> list[dict]:
    """One row per (degree, attention, mode): the slowest rank's ms per token (``rank_ms_per_token``
    lists all), the worst agreement and logits error, any rank's error."""
    merged: dict = {}
    for part in gather_rows({"rows": local}, world):
        for row in part["rows"]:
            key = (row["tp"], row["impl"], row["mode"])
            have = merged.setdefault(key, {**row, "rank_ms_per_token": []})
            if "error" in row:
                have["error"] = row["error"]
            if "ms_per_token" in row:
                have["rank_ms_per_token"].append(round(row["ms_per_token"], 4))
                have["ms_per_token"] = round(max(have["rank_ms_per_token"]), 4)
            for key_, worst in (("agreement_vs_tp1", min), ("logits_rel_err_vs_tp1", max)):
                if key_ in row:
                    have[key_] = worst(have[key_], row[key_])
            if "tokens_equal_tp1" in row:
                have["tokens_equal_tp1"] = have["tokens_equal_tp1"] and row["tokens_equal_tp1"]
    return list(merged.values())


def deepseek_summary(rows: list[dict]) -> dict:
    """The TP=d / TP=1 ms-per-token ratios per attention and mode, and the goals (module docstring)."""
    from tilefuse.bench.harness import check, ratio, tally
    from tilefuse.testing.parallel import rel_tolerance

    rows = [r for r in rows if r.get("kind") == KIND and "error" not in r]
    one = {(r["impl"], r["mode"]): r.get("ms_per_token") for r in rows if r["tp"] == 1}
    flash = {(r["tp"], r["mode"]): r.get("ms_per_token") for r in rows if r["impl"] == "flashmla"}
    table = [{"impl": r["impl"], "tp": r["tp"], "mode": r["mode"], "ms_per_token": r.get("ms_per_token"),
              "ratio_vs_tp1": ratio(r.get("ms_per_token"), one.get((r["impl"], r["mode"]))),
              "ratio_vs_flashmla": ratio(r.get("ms_per_token"), flash.get((r["tp"], r["mode"]))),
              "tokens_equal_tp1": r.get("tokens_equal_tp1"), "agreement_vs_tp1": r.get("agreement_vs_tp1"),
              "first_difference": r.get("first_difference"), "logits_rel_err_vs_tp1": r.get("logits_rel_err_vs_tp1")}
             for r in rows]
    many = [e for e in table if e["tp"] > 1]
    bound = rel_tolerance(torch.bfloat16)
    goals = [tally("DeepSeek-V3 shapes: the same greedy tokens as TP=1 at every degree",
                   [{"met": e["tokens_equal_tp1"]} for e in many]),
             tally(f"DeepSeek-V3 shapes: decode-step logits vs TP=1, relative error <= {bound:.4g} (bf16 rounding)",
                   [check("logits", e["logits_rel_err_vs_tp1"], "<=", bound) for e in many])]
    for degree, goal in ((2, TP2_GOAL), (8, TP8_GOAL)):
        graph = [e for e in many if e["tp"] == degree and e["mode"] == "graph" and e["impl"] == "tilefuse"]
        goals.append(check(f"DeepSeek-V3 shapes, batch 16, 32K context: TP={degree} / TP=1 decode ms/token, graph",
                           graph[0]["ratio_vs_tp1"] if graph else None, "<=", goal))
    return {"table": table, "goals": goals}


def print_deepseek(summary: dict, file=None) -> None:
    """The table of :func:`deepseek_summary` (its goals are printed with the benchmark's)."""
    file = file or sys.stdout
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    print("deepseek: decode ms/token (slowest rank), x TP=1 = this / TP=1 (same attention and mode), "
          "x FlashMLA = this / FlashMLA's (same TP and mode)", file=file)
    for e in summary["table"]:
        print(f"deepseek {e['impl']:<9} tp={e['tp']} {e['mode']:<5} {fmt(e['ms_per_token'])} ms/token, "
              f"{fmt(e['ratio_vs_tp1'])} x TP=1, {fmt(e['ratio_vs_flashmla'])} x FlashMLA, tokens equal to TP=1: "
              f"{e['tokens_equal_tp1']} (first difference {e['first_difference']}), logits rel err "
              f"{fmt(e['logits_rel_err_vs_tp1'], '.2e')}", file=file)
