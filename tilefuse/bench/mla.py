"""``tilefuse bench mla``: MLA decode over a paged cache, FlashMLA's grid and counting.

Grid: batch {16, 32, 64} x h_q {16, 32, 64, 128} x context {1K, 4K, 16K, 64K} x s_q {1, 2}, equal
lengths, causal, bf16, shuffled block tables; plus mixed lengths on a subset, 2-4 query tokens at 16
heads with uneven lengths, batch 128 at 1K, and 32/64 heads at 16K. Implementations:

* ``tilefuse``: the attention call alone, its metadata (``get_mla_metadata``) computed once per case
  outside the timed call, as engines compute it once per batch;
* ``tilefuse+metadata``: metadata + attention, one decode step as an engine captures it in a CUDA
  graph;
* ``tilefuse:transposed`` / ``tilefuse:standard``: ``tilefuse`` with one ``tl`` kernel forced
  (below 64 query rows, where both apply);
* ``tilefuse:wgmma``: the standard orientation's Gluon kernel forced (the default on Hopper; its
  64-row head tiles, ``configs.TRANSPOSED_GLUON_MAX_ROWS`` 0 for the call), at every case;
* ``tilefuse:wgmma-t``: the Gluon kernel's transposed form (``kernels_gluon_t``; the switch at 32
  rows for the call), at up to 32 query rows on Hopper;
* ``torch_naive``: gather the pages, bmm, softmax, bmm (equal lengths, where it fits in memory);
* ``flashmla`` / ``flashmla+metadata``: the same two for FlashMLA, where ``flash_mla`` is importable;
  with ``TILEFUSE_FLASHMLA=b31bfe7=DIR,main=DIR`` each named build instead, as ``flashmla@b31bfe7``,
  ``flashmla@main`` (both APIs: ``get_mla_metadata`` returning tensors, or main's schedule object
  that the first call fills).

Headline and goals (:func:`summarize`): a model plans the split schedule once per decode step and
runs the attention in every layer (61 in DeepSeek-V3), so each case is judged per layer: ``tilefuse``
(attention alone) against the faster FlashMLA build's attention alone, in graph replay (graph_us)
and, apart, eager (eager_us); the step (metadata + one attention, the ``+metadata`` rows) and the
model step (metadata + 61 x attention) follow as further columns. Goals, in graph mode on the
attention alone: the roofline fraction >= 0.9 at contexts >= 16K and >= 0.8 at 4K, >= 680 TFLOP/s
at 128 heads, faster than the faster FlashMLA build where FlashMLA is measured (and the model step
too); in eager mode <= 1.1 x that build's eager_us where FlashMLA is measured, else <= 1.3 x
tilefuse's own graph_us.
Launch-configuration sweeps live outside the library (``tools/mla_sweep.py``).
"""

from __future__ import annotations

import importlib
import json
import sys

import torch

from tilefuse import _env
from tilefuse.ops.mla import configs as _mla_configs
from tilefuse.ops.mla import op as _mla_op
from tilefuse.bench.harness import (Case, Goal, PlotSpec, check, compare, geomean, group_rows, host_goal, ratio,
                                    tally, upgrade_rows)
from tilefuse.testing.mla import flops_bytes, paged_cache, sparse_indices

H20 = {"tflops": 148.0, "tbps": 4.0}
_CACHE: dict = {}


def _cache(batch: int, max_len: int, device, dtype, page: int = 64):
    """One shared paged cache per (batch, context, page size): consecutive cases reuse it."""
    key = (batch, max_len, str(device), dtype, page)
    if key not in _CACHE:
        _CACHE.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _CACHE[key] = paged_cache([max_len] * batch, dtype, device, nan_tail=False, page_size=page)
    return _CACHE[key]


def _naive(q, k_cache, block_table, seqlens_list, causal):
    """Gather the pages, bmm, softmax, bmm (equal lengths only; the PyTorch baseline)."""
    batch, s_q, h_q, d = q.shape
    length = seqlens_list[0]
    pages = block_table[:, : (length + 63) // 64].long()
    kv = k_cache[pages].reshape(batch, -1, d)[:, :length]                       # [b, L, 576]
    scores = torch.bmm(q.reshape(batch, s_q * h_q, d), kv.transpose(1, 2)).float() * d ** -0.5
    if causal and s_q > 1:
        pos = torch.arange(length, device=q.device)
        last = length - s_q + torch.arange(s_q, device=q.device).repeat_interleave(h_q)
        scores = scores.masked_fill(pos[None, None, :] > last[None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]).to(q.dtype)
    return torch.bmm(p, kv[..., :512]).view(batch, s_q, h_q, 512), lse


_PEERS: dict | None = None


def flashmla_peers() -> dict:
    """``{impl name: flash_mla module}``: each build named in ``TILEFUSE_FLASHMLA`` (its folder put
    first on ``sys.path`` while ``flash_mla`` is imported, then the package's names dropped from
    ``sys.modules`` so the next build imports under the same name), else an installed ``flash_mla``
    as ``flashmla``, else nothing. Loaded once per process."""
    global _PEERS
    if _PEERS is not None:
        return _PEERS
    _PEERS = {}
    builds = _env.settings.flashmla or (("", None),)
    for label, folder in builds:
        ours = lambda name: name == "flash_mla" or name.startswith("flash_mla.") or name == "flash_mla_cuda"  # noqa: E731
        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
        if folder:
            sys.path.insert(0, folder)
        try:
            module = importlib.import_module("flash_mla")
        except ImportError as exc:
            if folder:
                raise ImportError(f"TILEFUSE_FLASHMLA: no importable flash_mla under {folder!r} ({exc})") from exc
            module = None
        finally:
            if folder:
                sys.path.remove(folder)
                for name in [name for name in sys.modules if ours(name)]:
                    del sys.modules[name]
            sys.modules.update(saved)
        if module is not None:
            _PEERS[f"flashmla@{label}" if label else "flashmla"] = module
    return _PEERS


def clear_cache() -> None:
    """Drop the shared paged cache (the next case allocates its own)."""
    _CACHE.clear()


def _attention_impls(lib, name: str, q, k_cache, block_table, lens, rows: int) -> dict:
    """``{name: attention with precomputed metadata, name+"+metadata": metadata + attention}`` for a
    module with FlashMLA's API (``tilefuse`` or ``flash_mla``)."""
    meta, splits = lib.get_mla_metadata(lens, rows, 1)

    def step():
        step_meta, step_splits = lib.get_mla_metadata(lens, rows, 1)
        return lib.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, step_meta, step_splits, causal=True)

    return {name: lambda: lib.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True),
            f"{name}+metadata": step}


def _gluon_form(attention, max_rows: int):
    """``attention`` with ``configs.TRANSPOSED_GLUON_MAX_ROWS`` set to ``max_rows`` for the call (0:
    the Gluon kernel's 64-row head tiles; 32: its transposed form up to 32 rows); the op plans
    per value of the switch, so nothing is re-planned per call."""
    def run():
        saved, _mla_configs.TRANSPOSED_GLUON_MAX_ROWS = _mla_configs.TRANSPOSED_GLUON_MAX_ROWS, max_rows
        try:
            return attention()
        finally:
            _mla_configs.TRANSPOSED_GLUON_MAX_ROWS = saved
    return run


def mla_case(batch: int, h_q: int, s_q: int, seqlens: list[int], device, dtype, mixed: bool = False,
             naive: bool = True, accuracy: bool = False, page: int = 64, label: str | None = None) -> Case:
    """One case: ``batch`` requests of ``seqlens`` tokens, ``h_q`` heads x ``s_q`` query tokens,
    cache pages of ``page`` tokens (FlashMLA runs only at 64); ``label`` names a length mix."""
    import tilefuse

    flops, nbytes = flops_bytes(seqlens, s_q, h_q)
    ctx = max(seqlens)
    rows = s_q * h_q
    params = {"batch": batch, "h_q": h_q, "s_q": s_q, "context": ctx if not mixed else f"mixed<={ctx}",
              "dtype": str(dtype).replace("torch.", "")}
    if page != 64:
        params["page"] = page
    if label:
        params["lengths"] = label

    state = {}

    def setup():
        k_cache, block_table = _cache(batch, ctx, device, dtype, page)
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=dtype)
        lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        state.update(q=q, lens=lens)

        def forced(variant):
            with tilefuse.force(variant=variant):  # the metadata as this variant schedules it
                attention = _attention_impls(tilefuse, "tilefuse", q, k_cache, block_table, lens, rows)["tilefuse"]

            def run():
                with tilefuse.force(variant=variant):
                    return attention()
            return run

        impls = _attention_impls(tilefuse, "tilefuse", q, k_cache, block_table, lens, rows)
        if device.type == "cuda" and rows < 64:   # every kernel applies: time each
            impls["tilefuse:transposed"] = forced("transposed")
            impls["tilefuse:standard"] = forced("standard")
        if device.type == "cuda":   # the Gluon kernel (its 64-row head tiles), at every case
            impls["tilefuse:wgmma"] = _gluon_form(forced("wgmma"), 0)
        if device.type == "cuda" and rows <= 32 and _mla_op.wgmma_usable(device):
            # the Gluon kernel's transposed form (kernels_gluon_t), where it applies
            impls["tilefuse:wgmma-t"] = _gluon_form(forced("wgmma"), 32)
        if naive and not mixed:
            impls["torch_naive"] = lambda: _naive(q, k_cache, block_table, seqlens, True)
        if device.type == "cuda" and page == 64:   # peer builds, only where present (never built by tilefuse)
            for name, module in flashmla_peers().items():
                impls.update(_attention_impls(module, name, q, k_cache, block_table, lens, rows))
        return impls

    def extras(impls):
        """cos_diff and RMSE of out and lse against the fp64 reference, for each tilefuse impl."""
        from tilefuse.ops.mla.reference import mla_decode_reference
        from tilefuse.testing.compare import cos_diff

        k_cache, block_table = _cache(batch, ctx, device, dtype, page)
        ro, rl = mla_decode_reference(state["q"], k_cache, block_table, state["lens"], 512, causal=True,
                                      compute_dtype=torch.float64)
        result = {}
        for name, fn in impls.items():
            if name.startswith("tilefuse"):
                out, lse = fn()
                result[name] = {"cos_diff_out": cos_diff(out, ro), "cos_diff_lse": cos_diff(lse, rl),
                                "rmse_out": float(((out.double() - ro) ** 2).mean().sqrt()),
                                "rmse_lse": float(((lse.double() - rl) ** 2).mean().sqrt())}
        return result

    return Case(params=params, flops=flops, bytes=nbytes, setup=setup, extras=extras if accuracy else None)


def cases(device: torch.device, quick: bool, subset: bool = False) -> list[Case]:
    """The grid above on a GPU (quick: batch 16/64 x 16/128 heads x 4K/64K, s_q 1), then mixed
    lengths, s_q 3-4 at 16 heads with uneven lengths, batch 128 at 1K, 32 and 64 heads at 16K, the
    serving mixes (:func:`serving_cases`), pages of 16, 32 and 128 tokens and the FP8-cache cases
    (:func:`fp8_cases`); tiny cases on a CPU.
    ``subset`` (an ``--only`` run) changes nothing here."""
    dtype = torch.bfloat16
    if device.type != "cuda":
        # CPU: the reference path on tiny shapes, to check the pipeline anywhere.
        return [mla_case(2, h, 1, [256, 256], device, torch.float32, naive=True) for h in (16, 128)] + \
            fp8_cases(device, quick)
    batches, heads, contexts, sqs = (16, 32, 64), (16, 32, 64, 128), (1024, 4096, 16384, 65536), (1, 2)
    if quick:
        batches, heads, contexts, sqs = (16, 64), (16, 128), (4096, 65536), (1,)
    out = []
    for batch in batches:
        for ctx in contexts:           # grouped by (batch, context): the cache is shared
            for h_q in heads:
                for s_q in sqs:
                    naive = batch * ctx <= 16 * 65536 and batch * h_q * s_q * ctx * 4 <= (2 << 30)
                    acc = batch == 16 and ctx == 4096 and s_q == 1 and h_q in (16, 128)
                    out.append(mla_case(batch, h_q, s_q, [ctx] * batch, device, dtype, naive=naive, accuracy=acc))
    gen = torch.Generator().manual_seed(0)

    def uneven(batch: int, ctx: int) -> list[int]:
        """Lengths uniform in [64, 2 ctx - 64] around a mean of ctx, one zero and one tiny."""
        lens = torch.randint(64, 2 * ctx - 64, (batch,), generator=gen)
        lens[:2] = torch.tensor([0, 1])
        return lens.tolist()

    for batch in (16, 64) if not quick else (16,):
        for ctx in (4096, 16384):
            lens = uneven(batch, ctx)
            for h_q in (16, 128):
                out.append(mla_case(batch, h_q, 1, lens, device, dtype, mixed=True))
    # Speculative decoding at 16 heads (2-4 query tokens, uneven lengths), many short requests, and
    # the middle head counts (a 128-head model over 2-4 GPUs).
    for s_q in (3, 4):
        out.append(mla_case(16, 16, s_q, uneven(16, 4096), device, dtype, mixed=True))
    for h_q in (16, 128):
        out.append(mla_case(128, h_q, 1, [1024] * 128, device, dtype, naive=False))
    for h_q in (32, 64):
        out.append(mla_case(32, h_q, 1, [16384] * 32, device, dtype, naive=False))
    out += serving_cases(device, dtype)
    # cache pages other than FlashMLA's 64 (vLLM's 16; 32, 128): tilefuse against itself at 64
    for page in (16, 32, 128):
        out.append(mla_case(16, 16, 1, [4096] * 16, device, dtype, naive=False, page=page))
    return out + fp8_cases(device, quick)


def serving_mixes() -> list[tuple[int, int, int, list[int], str]]:
    """``(batch, h_q, s_q, lengths, label)`` of the length mixes a server sees: one long request
    sharing the batch with short ones (the split schedule's hard case), Zipf-distributed lengths,
    and 96 query rows per KV head (24 heads x 4 tokens)."""
    gen = torch.Generator().manual_seed(1)
    mixed96 = torch.randint(1, 20000, (96,), generator=gen).tolist()
    mixed96[0] = 70000
    one_long = [131072] + torch.randint(1, 2000, (255,), generator=gen).tolist()
    zipf = (20000 / torch.arange(1, 129, dtype=torch.float64) ** 1.1).long().clamp_min(1).tolist()
    uniform = "uniform 1-20000, one 70000"
    return [(3, 8, 4, [1, 300, 70000], "1,300,70000"), (4, 24, 4, [1, 300, 70000, 4097], "1,300,70000,4097"),
            (3, 24, 1, [70000, 4097, 300], "70000,4097,300"), (96, 8, 4, mixed96, uniform),
            (96, 24, 1, mixed96, uniform), (96, 24, 4, mixed96, uniform),
            (64, 16, 2, [8192] * 64, "8192 each"), (32, 128, 1, [32768] * 32, "32768 each"),
            (256, 16, 1, one_long, "one 131072, 255 uniform 1-2000"), (128, 16, 2, zipf, "Zipf 20000 / i^1.1"),
            (128, 64, 1, zipf, "Zipf 20000 / i^1.1")]


def serving_cases(device, dtype) -> list[Case]:
    """The cases of :func:`serving_mixes`."""
    return [mla_case(b, h, sq, lens, device, dtype, mixed=True, naive=False, label=label)
            for b, h, sq, lens, label in serving_mixes()]


# ----------------------------------------------------------------------------- FP8 cache, sparse
def fp8_paged_cache(seqlens: list[int], device, page: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache in FlashMLA's 656-byte FP8 layout (``[num_blocks, page, 1, 656]`` uint8) and
    its shuffled block table: N(0, 1) latents quantized by ``mla_quantize_kv``, 4096 pages at a
    time so that no fp32 copy of the whole cache is made."""
    from tilefuse.ops.mla.kv import mla_quantize_kv

    max_blocks = max([-(-n // page) for n in seqlens] + [1])
    num_blocks = len(seqlens) * max_blocks
    packed = torch.empty(num_blocks, page, 1, 656, dtype=torch.uint8, device=device)
    for first in range(0, num_blocks, 4096):
        last = min(first + 4096, num_blocks)
        packed[first:last] = mla_quantize_kv(torch.randn(last - first, page, 1, 576, device=device))
    block_table = torch.randperm(num_blocks).view(len(seqlens), max_blocks).to(torch.int32).to(device)
    return packed, block_table


def _sparse_peers() -> dict:
    """The FlashMLA builds whose ``flash_mla_with_kvcache`` takes ``indices`` (main's sparse FP8 decode)."""
    import inspect

    return {name: module for name, module in flashmla_peers().items()
            if "indices" in inspect.signature(module.flash_mla_with_kvcache).parameters}


def sparse_case(batch: int, h_q: int, s_q: int, seqlens: list[int], device, topk: int = 2048,
                with_length: bool = False, label: str | None = None) -> Case:
    """One sparse (top-k) decode step over an FP8 cache, DeepSeek-V3.2's: ``batch`` requests of
    ``seqlens`` tokens, ``h_q`` heads x ``s_q`` query tokens, each token attending to ``topk``
    cached tokens (fewer, -1 padded, in a request shorter than ``topk``; ``with_length`` also
    passes ``topk_length``). Implementations: ``tilefuse`` (the default path), ``tilefuse:sparse``
    (the tl gather kernel pinned), ``tilefuse:dense-bf16`` (tilefuse's bf16 dense decode of the
    same number of tokens per request: the work without the gather or the FP8 bytes), and each
    FlashMLA build with sparse decode, its q padded to 64 heads below 64 as engines pad it
    (``flashmla@main`` with the schedule precomputed, ``+metadata`` with it made in the step).
    Roofline bytes: the valid tokens' 656 bytes each, the indices, q and out."""
    import tilefuse

    valid = [min(topk, n) for n in seqlens]
    units_tokens = s_q * sum(valid)
    flops = 2.0 * h_q * units_tokens * (576 + 512)
    nbytes = units_tokens * 656.0 + batch * s_q * (topk * 4 + h_q * (576 + 512) * 2)
    params = {"batch": batch, "h_q": h_q, "s_q": s_q, "context": max(seqlens), "topk": topk, "kv": "fp8",
              "dtype": "bfloat16"}
    if with_length:
        params["topk_length"] = True
    if label:
        params["lengths"] = label

    def setup():
        gen = torch.Generator().manual_seed(batch * 1000 + h_q * 10 + s_q)
        k_cache, block_table = fp8_paged_cache(seqlens, device)
        idx, lengths = sparse_indices(seqlens, s_q, topk, block_table, 64, gen)
        length = lengths if with_length else None
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=torch.bfloat16)

        def ours():
            return tilefuse.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None, is_fp8_kvcache=True,
                                                   indices=idx, topk_length=length)

        def pinned():
            with tilefuse.force(variant="standard"):
                return ours()

        def gather_dense_pinned(on: bool):
            """The default path with gather + dense pinned on (wherever it runs) or off (the Gluon
            sparse kernel)."""
            def run():
                saved, _mla_configs.SPARSE_GATHER_DENSE = _mla_configs.SPARSE_GATHER_DENSE, on
                try:
                    return ours()
                finally:
                    _mla_configs.SPARSE_GATHER_DENSE = saved
            return run

        impls = {"tilefuse": ours}
        if device.type == "cuda" and not _mla_op.fp8_sparse_kernels_run(q):
            impls["tilefuse:sparse"] = pinned
        if device.type == "cuda" and _mla_op.fp8_sparse_kernels_run(q) and q.dtype == torch.bfloat16 and h_q > 8:
            impls["tilefuse:sparse-gluon"] = gather_dense_pinned(False)
            impls["tilefuse:gather-dense"] = gather_dense_pinned(True)
        dense_cache, dense_table = paged_cache(valid, torch.bfloat16, device, nan_tail=False)
        dense_lens = torch.tensor(valid, dtype=torch.int32, device=device)
        impls["tilefuse:dense-bf16"] = _attention_impls(tilefuse, "tilefuse", q, dense_cache, dense_table,
                                                        dense_lens, s_q * h_q)["tilefuse"]
        if device.type == "cuda":
            padded = torch.zeros(batch, s_q, max(64, h_q), 576, device=device, dtype=q.dtype)
            padded[:, :, :h_q] = q
            fp8_view = k_cache.view(torch.float8_e4m3fn)
            for name, module in _sparse_peers().items():
                # FlashMLA main's Hopper kernel takes no topk_length (it asserts): the -1 padding
                # past each list's valid entries says the same to it
                def peer(sched, module=module):
                    return module.flash_mla_with_kvcache(padded, fp8_view, None, None, 512, sched, None,
                                                         is_fp8_kvcache=True, indices=idx)

                sched = module.get_mla_metadata()[0]
                peer(sched)   # fills the schedule
                impls[name] = lambda peer=peer, sched=sched: peer(sched)
                impls[f"{name}+metadata"] = lambda peer=peer, module=module: peer(module.get_mla_metadata()[0])
        state.update(q=q, k_cache=k_cache, idx=idx, length=length)
        return impls

    state: dict = {}

    def extras(impls):
        """cos_diff of out and lse against the fp64 reference on the dequantized cache."""
        from tilefuse.ops.mla.reference import mla_sparse_decode_reference
        from tilefuse.testing.compare import cos_diff

        ro, rl = mla_sparse_decode_reference(state["q"], state["k_cache"], state["idx"], topk_length=state["length"],
                                             compute_dtype=torch.float64)
        result = {}
        for name in ("tilefuse", "tilefuse:sparse"):
            if name in impls:
                out, lse = impls[name]()
                finite = torch.isfinite(rl)
                result[name] = {"cos_diff_out": cos_diff(out, ro), "cos_diff_lse": cos_diff(lse[finite], rl[finite])}
        return result

    return Case(params=params, flops=flops, bytes=nbytes, setup=setup, extras=extras if batch <= 16 else None)


def fp8_dense_case(batch: int, h_q: int, s_q: int, ctx: int, device) -> Case:
    """One dense decode step over an FP8 cache (656 bytes per token): ``tilefuse`` (the default
    path), ``tilefuse:fp8`` (the tl split kernels pinned, dequantizing each tile as they load it,
    where the default is the reference) or ``tilefuse:fp8-tl`` (the same beside the Gluon kernel),
    and the bf16 decode of the dequantized cache (``tilefuse:dense-bf16``, tilefuse's default
    dense path; each FlashMLA build as ``flashmla@...``): the bytes an FP8 cache saves."""
    import tilefuse

    seqlens = [ctx] * batch
    flops, _ = flops_bytes(seqlens, s_q, h_q)
    nbytes = batch * ctx * 656.0 + batch * s_q * h_q * (576 + 512) * 2
    params = {"batch": batch, "h_q": h_q, "s_q": s_q, "context": ctx, "kv": "fp8", "dtype": "bfloat16"}

    def setup():
        from tilefuse.ops.mla.kv import mla_dequantize_kv

        k_cache, block_table = fp8_paged_cache(seqlens, device)
        q = torch.randn(batch, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
        lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        meta, splits = tilefuse.get_mla_metadata(lens, s_q * h_q, 1)

        def ours():
            return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                                   is_fp8_kvcache=True)

        # the tl kernels' own rule, the FP8 default before the Gluon kernel (op._fp8_variant)
        tl_variant = _mla_op.configs.default_variant(s_q * h_q, block_table.shape[1], False, _mla_op._chip_ridge(q))

        def ours_variant():
            return tilefuse.explain(tilefuse.flash_mla_with_kvcache, q, k_cache, block_table, lens,
                                    is_fp8_kvcache=True).variant

        def pinned():
            with tilefuse.force(variant=tl_variant):
                pinned_meta, pinned_splits = tilefuse.get_mla_metadata(lens, s_q * h_q, 1)
                return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, pinned_meta,
                                                       pinned_splits, causal=True, is_fp8_kvcache=True)

        impls = {"tilefuse": ours}
        if device.type == "cuda" and not _mla_op.fp8_sparse_kernels_run(q):
            impls["tilefuse:fp8"] = pinned
        elif device.type == "cuda" and ours_variant() != tl_variant:
            impls["tilefuse:fp8-tl"] = pinned          # the tl kernels, the default before the Gluon one
        bf16 = mla_dequantize_kv(k_cache, torch.bfloat16)
        impls["tilefuse:dense-bf16"] = _attention_impls(tilefuse, "tilefuse", q, bf16, block_table, lens,
                                                        s_q * h_q)["tilefuse+metadata"]
        if device.type == "cuda":
            for name, module in flashmla_peers().items():
                impls[name] = _attention_impls(module, name, q, bf16, block_table, lens, s_q * h_q)[f"{name}+metadata"]
        return impls

    return Case(params=params, flops=flops, bytes=nbytes, setup=setup)


def fp8_cases(device: torch.device, quick: bool) -> list[Case]:
    """FP8-cache cases: sparse decode at heads 8-128, s_q 1-2 (4 in the full grid), batch 16 and
    128 (and 64) over 32K contexts (8K and 128K at 16 heads), two mixes with requests shorter than
    topk and ``topk_length`` (16 and 48 heads); dense FP8 decode at 16-128 heads. Tiny cases on a CPU."""
    if device.type != "cuda":
        return [sparse_case(2, 16, 1, [300, 100], device, topk=128, with_length=True)]
    heads, sqs, batches = (8, 16, 32, 64, 128), (1, 2) if quick else (1, 2, 4), (16, 128) if quick else (16, 64, 128)
    out = [sparse_case(b, h, sq, [32768] * b, device) for b in batches for h in heads for sq in sqs]
    for ctx in (8192, 131072):
        out.append(sparse_case(64, 16, 1, [ctx] * 64, device))
    gen = torch.Generator().manual_seed(2)
    mixed = torch.randint(100, 32768, (128,), generator=gen).tolist()
    out.append(sparse_case(128, 16, 1, mixed, device, with_length=True, label="uniform 100-32768"))
    out.append(sparse_case(64, 48, 1, mixed[:64], device, with_length=True, label="uniform 100-32768"))
    for b, h, sq, ctx in ((16, 16, 1, 8192), (64, 16, 2, 8192), (16, 128, 1, 8192), (64, 64, 1, 16384),
                          (16, 16, 1, 32768), (128, 8, 4, 16384), (32, 32, 1, 16384)):
        out.append(fp8_dense_case(b, h, sq, ctx, device))
    return out


# ----------------------------------------------------------------------------- summary
# Older results files timed "tilefuse" as metadata + attention: read them under today's name.
LEGACY_IMPLS = {"tilefuse": "tilefuse+metadata"}
PEER_GOAL = "per layer, graph: attention alone faster than the faster FlashMLA build's"
SHORT_GOAL = "per layer, graph: speedup >= 1.3 over FlashMLA at context <= 4K or h_q 16 with s_q 2-4"
MODEL_LAYERS = 61                      # DeepSeek-V3's layers: the attention runs 61 times per metadata
MODEL_GOAL = f"model step, graph: metadata + {MODEL_LAYERS} x attention faster than the faster FlashMLA build's"
LEVELS = ("layer", "step", "model")
TFLOPS_GOAL = 680
ROOFLINE_GOALS = (("roofline >= 0.9 at context >= 16K", lambda c: isinstance(c, int) and c >= 16384, 0.9),
                  ("roofline >= 0.8 at 4K", lambda c: c == 4096, 0.8))
PLOT = PlotSpec(
    x="context", line=("h_q",), style="s_q", facet="batch",
    goals={"eager": [Goal(1 / 1.1, "host goal: >= 1/1.1 of FlashMLA", vs="flashmla")],
           "graph": [Goal(1.0, "goal: faster than FlashMLA", vs="flashmla")],
           "host": [Goal(1.3, "host goal without FlashMLA: <= 1.3", not_vs="flashmla")],
           "roofline": [Goal(0.9, "goal", xs=(16384, 65536)), Goal(0.8, "goal", xs=(4096, 4096))]})


def _short(params: dict) -> bool:
    """Where the faster-than-FlashMLA bar is 1.3x: short contexts, and 16 heads with 2-4 query tokens."""
    context = params["context"]
    ctx = context if isinstance(context, int) else int(str(context).rsplit("=", 1)[-1])
    return ctx <= 4096 or (params["h_q"] == 16 and 2 <= params["s_q"] <= 4)


def _fastest(impls: dict, builds: list[str], suffix: str, key: str) -> str | None:
    """The FlashMLA build whose ``<build><suffix>`` row has the least ``key`` (None: none timed)."""
    timed = [b for b in builds if (impls.get(f"{b}{suffix}") or {}).get(key)]
    return min(timed, key=lambda b: impls[f"{b}{suffix}"][key], default=None)


def model_step_us(step_us: float | None, attention_us: float | None, layers: int = MODEL_LAYERS) -> float | None:
    """One model decode step's attention time: the metadata once, then ``layers`` attention calls,
    = ``step_us`` (metadata + one attention) + ``(layers - 1) x attention_us`` (None if either is missing)."""
    return step_us + (layers - 1) * attention_us if step_us and attention_us else None


def _levels(impls: dict, builds: list[str], mode: str) -> dict:
    """tilefuse against the faster FlashMLA build at each level of one case, in ``mode`` ("eager" or
    "graph"): ``layer`` (attention alone, metadata computed once), ``step`` (metadata + one
    attention) and ``model`` (metadata + :data:`MODEL_LAYERS` x attention); the faster build is
    picked at each level by that level's time. Each level: ``{"us", "peer", "peer_us", "speedup"}``
    (speedup = peer time / tilefuse time, > 1: tilefuse faster)."""
    key = f"{mode}_us"
    get = lambda impl: (impls.get(impl) or {}).get(key)  # noqa: E731
    ours = {"layer": get("tilefuse"), "step": get("tilefuse+metadata")}
    ours["model"] = model_step_us(ours["step"], ours["layer"])
    peers = {"layer": {b: get(b) for b in builds}, "step": {b: get(f"{b}+metadata") for b in builds}}
    peers["model"] = {b: model_step_us(peers["step"][b], peers["layer"][b]) for b in builds}
    out = {}
    for level in LEVELS:
        timed = {b: us for b, us in peers[level].items() if us}
        peer = min(timed, key=timed.get, default=None)
        out[level] = {"us": ours[level], "peer": peer, "peer_us": timed.get(peer),
                      "speedup": ratio(timed.get(peer), ours[level])}
    return out


def headline(cases: list[dict]) -> dict:
    """The figures the docs quote, from the cases measured against FlashMLA: per mode and level
    (:func:`_levels`), ``time_ratio_geomean`` (tilefuse time / the faster FlashMLA build's, geomean:
    above 1, tilefuse slower), ``at_or_ahead`` (cases with speedup >= 1) and ``of``."""
    out = {"layers": MODEL_LAYERS}
    for mode in ("graph", "eager"):
        for level in LEVELS:
            speedups = [c["levels"][mode][level]["speedup"] for c in cases if c.get("levels")]
            speedups = [x for x in speedups if x]
            out.setdefault(mode, {})[level] = {
                "time_ratio_geomean": None if not speedups else round(1 / geomean(speedups), 4),
                "at_or_ahead": sum(x >= 1.0 for x in speedups), "of": len(speedups)}
    return out


def summarize(rows: list[dict]) -> dict:
    """The family's goals from one run's rows, judged per layer, eager and graph apart.

    A model plans the split schedule once per decode step and runs the attention in every layer,
    so the headline is the attention alone (``tilefuse``, metadata computed once outside the timed
    call) against the faster FlashMLA build's attention alone, in graph replay; the step (metadata
    + one attention, ``tilefuse+metadata``) and the model step (metadata + :data:`MODEL_LAYERS` x
    attention, :func:`model_step_us`) follow as further levels.

    Keys: ``timing``; ``headline`` (:func:`headline`); ``cases`` (one
    :func:`~tilefuse.bench.harness.compare` entry per case: eager and graph both ``tilefuse``'s
    attention alone, against the faster FlashMLA build's attention alone in that mode, else
    ``torch_naive``; ``levels`` (:func:`_levels`, eager and graph) where FlashMLA is measured;
    ``flashmla_builds`` (each build's attention and step times); host goal; roofline and FlashMLA
    goals, on the attention alone); ``goals`` (tallies, worst TFLOP/s at 128 heads >= 16K);
    ``kernels_side_by_side`` (eager and graph); ``h20_roofline_prediction`` (``[case, padded us,
    transposed us, gain, H20 kernel]``); ``accuracy`` (cos_diff of out and lse against fp64 under
    1e-5, FlashMLA's level being ~2e-6).
    """
    rows = upgrade_rows(rows, LEGACY_IMPLS)
    fp8_rows = [r for r in rows if r["params"].get("kv") == "fp8"]
    rows = [r for r in rows if r["params"].get("kv") != "fp8"]
    # one case per (batch, h_q, s_q, context, page): the page-size cases share the rest with a
    # 64-token case and must not replace its rows
    table = group_rows([{**r, "params": {"page": 64, **r["params"]}} for r in rows],
                       ("batch", "h_q", "s_q", "context", "page"))
    cases = []
    for key, impls in table.items():
        builds = sorted(name for name in impls if name.startswith("flashmla") and not name.endswith("+metadata"))
        fast_eager, fast_graph = _fastest(impls, builds, "", "eager_us"), _fastest(impls, builds, "", "graph_us")
        measured = fast_graph is not None
        if measured:
            baseline = (fast_eager or fast_graph, fast_graph)
        else:
            baseline = ("torch_naive", "torch_naive") if "torch_naive" in impls else None
        entry = compare(_label(key), next(iter(impls.values()))["params"], impls, ("tilefuse", "tilefuse"), baseline)
        entry["graph_baseline"] = baseline[1] if baseline else None
        if measured:
            entry["levels"] = {mode: _levels(impls, builds, mode) for mode in ("graph", "eager")}
        entry["flashmla_builds"] = {
            b: {"eager_us": impls[b].get("eager_us"), "graph_us": impls[b].get("graph_us"),
                "step_graph_us": (impls.get(f"{b}+metadata") or {}).get("graph_us"),
                "tflops": impls[b].get("tflops"), "graph_speedup": ratio(impls[b].get("graph_us"), entry["graph_us"])}
            for b in builds if impls[b].get("graph_us")}
        entry["host_goal"] = (host_goal(entry, baseline_factor=1.1) if measured
                              else host_goal(entry, graph_factor=1.3))
        context = entry["params"]["context"]
        entry["kernel_goals"] = [check(name, entry["roofline_frac"], ">=", bar)
                                 for name, applies, bar in ROOFLINE_GOALS if applies(context)]
        if measured:
            entry["kernel_goals"].append(check(PEER_GOAL, entry["graph_speedup"], ">=", 1.0))
            if _short(entry["params"]):
                entry["kernel_goals"].append(check(SHORT_GOAL, entry["graph_speedup"], ">=", 1.3))
            entry["kernel_goals"].append(check(MODEL_GOAL, entry["levels"]["graph"]["model"]["speedup"], ">=", 1.0))
        cases.append(entry)

    goals = [tally(name, (c for e in cases for c in e["kernel_goals"] if c["goal"] == name))
             for name, _, _ in ROOFLINE_GOALS]
    h128 = [r for r in rows if r["impl"] == "tilefuse" and r["params"]["h_q"] == 128
            and isinstance(r["params"]["context"], int) and r["params"]["context"] >= 16384 and r.get("tflops")]
    goals.append(check("graph, attention alone: TFLOP/s at h_q = 128, context >= 16K (worst case)",
                       min((r["tflops"] for r in h128), default=None), ">=", TFLOPS_GOAL))
    for name in (PEER_GOAL, SHORT_GOAL, MODEL_GOAL):
        goals.append(tally(name, (c for e in cases for c in e["kernel_goals"] if c["goal"] == name)))
    goals.append(tally("eager, attention alone: eager_us <= 1.1 x the faster FlashMLA build's eager_us "
                       "(without FlashMLA: <= 1.3 x own graph_us)", (e["host_goal"] for e in cases)))
    return {
        "timing": "per layer (the headline): tilefuse's attention alone (metadata computed once, outside the timed "
                  "call) against the faster FlashMLA build's attention alone, eager (eager_us) and graph (graph_us, "
                  "one call in a CUDA graph, cold L2) apart, else torch_naive's; step: metadata + one attention "
                  "(the +metadata rows); model step: metadata + %d x attention = step + %d x attention; roofline "
                  "fractions and TFLOP/s from the attention alone's graph_us" % (MODEL_LAYERS, MODEL_LAYERS - 1),
        "headline": headline(cases),
        "cases": cases,
        "goals": goals,
        "kernels_side_by_side": _orientations(table),
        "h20_roofline_prediction": _h20(table)[:24],
        "accuracy": _accuracy(rows),
        "fp8_cache": summarize_fp8(fp8_rows),
    }


def print_family_summary(summary: dict, file) -> None:
    """The per-layer table: per case the graph speedups over the faster FlashMLA build (attention
    alone, then the step and the model step), the eager attention's speedup, the host factor and the
    roofline fraction, then the headline, the goals and the FP8-cache table."""
    from tilefuse.bench.runner import _fmt, _verdict

    cases = summary["cases"]
    width = max([len(e["case"]) for e in cases] + [4])
    x = lambda v: _fmt(v, ".2f", "x")  # noqa: E731
    level = lambda e, mode, name: ((e.get("levels") or {}).get(mode) or {}).get(name, {}).get("speedup")  # noqa: E731
    print(f"\nmla: speedup = the faster FlashMLA build's time / tilefuse's (> 1: tilefuse faster); layer: attention "
          f"alone, metadata computed once (what {summary['headline']['layers'] - 1} of "
          f"{summary['headline']['layers']} layers pay); step: metadata + one attention; model: metadata + "
          f"{summary['headline']['layers']} x attention; host: tilefuse eager_us / its graph_us", file=file)
    print(f"{'case':<{width}}  {'graph:layer':>11} {'step':>6} {'model':>6}  {'eager:layer':>11} {'step':>6}  "
          f"{'baseline':<16} {'host':>5} {'roof':>5}  host goal  kernel goal", file=file)
    for e in cases:
        print(f"{e['case']:<{width}}  {x(e['graph_speedup']):>11} {x(level(e, 'graph', 'step')):>6} "
              f"{x(level(e, 'graph', 'model')):>6}  {x(e['eager_speedup']):>11} {x(level(e, 'eager', 'step')):>6}  "
              f"{e.get('graph_baseline') or '-':<16} {_fmt(e['eager_over_graph']):>5} {_fmt(e['roofline_frac']):>5}  "
              f"{_verdict([e['host_goal']]):<9}  {_verdict(e['kernel_goals'])}", file=file)
    head = summary["headline"]
    for mode in ("graph", "eager"):
        parts = [f"{name} {_fmt(h['time_ratio_geomean'], '.3f', 'x')} the time, at or ahead in {h['at_or_ahead']}/"
                 f"{h['of']}" for name, h in head[mode].items() if h["of"]]
        if parts:
            print(f"mla headline, {mode} (time ratio tilefuse / the faster FlashMLA build, geomean): "
                  + "; ".join(parts), file=file)
    print("mla goals:", file=file)
    for goal in summary["goals"]:
        measured = (f"met in {goal['met_in']}/{goal['of']} cases" if "met_in" in goal
                    else f"{_fmt(goal['measured'], '.3f')} (target {goal['target']})")
        state = {True: "ok", False: "FAIL", None: "not measured"}[goal["met"]]
        print(f"  [{state}] {goal['goal']}: {measured}", file=file)
    print_family_extra(summary, file)


SPARSE_GOALS = ((8, 3.0), (16, 2.0))   # h_q: graph speedup over FlashMLA padded to 64 heads (s_q 1-2, batch >= 16)


def summarize_fp8(rows: list[dict]) -> dict:
    """The FP8-cache cases (:func:`fp8_cases`): per case tilefuse's kernel (the default path, or
    the pinned kernel while the default is the reference) against the faster sparse FlashMLA build
    (graph: its ``+metadata`` row, q padded to 64 heads below 64) and against tilefuse's bf16
    decode of the same tokens; the fraction of the copy bandwidth reached on the bytes read; the
    goals: >= 3x FlashMLA at 8 heads and >= 2x at 16 (s_q 1-2), cos_diff < 1e-5."""
    table: dict = {}
    for row in rows:
        table.setdefault(json.dumps(row["params"], sort_keys=True), {})[row["impl"]] = row
    cases, goals = [], {h: [] for h, _ in SPARSE_GOALS}
    for impls in table.values():
        params = next(iter(impls.values()))["params"]
        key = tuple(params.get(k) for k in ("batch", "h_q", "s_q", "context", "topk", "lengths"))
        ours = next((n for n in ("tilefuse:sparse", "tilefuse:fp8") if n in impls), "tilefuse")
        peers = [n for n in impls if n.startswith("flashmla") and (impls[n].get("graph_us") or 0) > 0
                 and (params.get("topk") is None or n.endswith("+metadata"))]
        peer = min(peers, key=lambda n: impls[n]["graph_us"], default=None)
        get = lambda impl, k: (impls.get(impl) or {}).get(k)  # noqa: E731
        entry = {"case": "b{} h{} s{} {}".format(*key[:4]) + (f" topk {key[4]}" if key[4] else " dense")
                 + (f" ({key[5]})" if key[5] else ""), "params": params, "kernel": ours,
                 "graph_us": get(ours, "graph_us"), "eager_us": get(ours, "eager_us"),
                 "default_graph_us": get("tilefuse", "graph_us"), "roofline_frac": get(ours, "roofline_frac"),
                 "gbps": get(ours, "gbps"), "peer": peer, "peer_graph_us": get(peer, "graph_us"),
                 "dense_bf16_graph_us": get("tilefuse:dense-bf16", "graph_us"),
                 "fp8_tl_graph_us": get("tilefuse:fp8-tl", "graph_us"),
                 "cos_diff_out": get(ours, "cos_diff_out")}
        entry["speedup_vs_peer"] = ratio(entry["peer_graph_us"], entry["graph_us"])
        entry["speedup_vs_dense_bf16"] = ratio(entry["dense_bf16_graph_us"], entry["graph_us"])
        entry["speedup_vs_fp8_tl"] = ratio(entry["fp8_tl_graph_us"], entry["graph_us"])
        for h, bar in SPARSE_GOALS:
            if params.get("topk") and params["h_q"] == h and params["s_q"] <= 2 and params["batch"] >= 16:
                goals[h].append(check(f"sparse h{h}: graph speedup over FlashMLA padded >= {bar:g}",
                                      entry["speedup_vs_peer"], ">=", bar))
        cases.append(entry)
    return {"timing": "graph_us of tilefuse's kernel (the pinned one while the default is the reference) against "
                      "the faster sparse FlashMLA build's +metadata graph_us (q padded to 64 heads below 64) and "
                      "tilefuse's bf16 dense decode of the same tokens; roofline on the bytes read",
            "cases": cases,
            "goals": [tally(f"sparse h{h}: graph speedup over FlashMLA padded >= {bar:g}", goals[h])
                      for h, bar in SPARSE_GOALS]}


def print_family_extra(summary: dict, file) -> None:
    """The FP8-cache cases of :func:`summarize_fp8` as a table, then their goals."""
    fp8 = summary.get("fp8_cache") or {}
    if not fp8.get("cases"):
        return
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    width = max(len(e["case"]) for e in fp8["cases"])
    print(f"\nmla, FP8 cache: graph us of tilefuse's kernel, its default path, the faster FlashMLA "
          "(sparse: padded to 64 heads), tilefuse's bf16 dense of the same tokens", file=file)
    print(f"{'case':<{width}}  {'us':>7} {'default':>8} {'peer':>7} {'bf16':>7} {'x peer':>6} {'x bf16':>6} "
          f"{'GB/s':>6} {'roof':>5} {'cos_diff':>8}", file=file)
    for e in fp8["cases"]:
        print(f"{e['case']:<{width}}  {f(e['graph_us'], '.1f'):>7} {f(e['default_graph_us'], '.1f'):>8} "
              f"{f(e['peer_graph_us'], '.1f'):>7} {f(e['dense_bf16_graph_us'], '.1f'):>7} "
              f"{f(e['speedup_vs_peer']):>6} {f(e['speedup_vs_dense_bf16']):>6} {f(e['gbps'], '.0f'):>6} "
              f"{f(e['roofline_frac']):>5} {f(e['cos_diff_out'], '.1e'):>8}", file=file)
    for goal in fp8["goals"]:
        print(f"  {goal['goal']}: met in {goal['met_in']}/{goal['of']} cases", file=file)


def _orientations(table: dict) -> dict:
    """Geomean time ratios of the kernels forced side by side, eager and graph: ``"a/b"`` = a's
    time over b's (below 1: a faster), and in how many cases b is faster. The tl kernels are
    forced below 64 rows, the Gluon kernel (``wgmma``: its 64-row head tiles) everywhere, its
    transposed form (``wgmma-t``) up to 32 rows."""
    out = {}
    for a, b in (("standard", "transposed"), ("wgmma", "standard"), ("wgmma", "transposed"), ("wgmma-t", "wgmma")):
        for mode, key in (("eager", "eager_us"), ("graph", "graph_us")):
            pairs = [((impls.get(f"tilefuse:{a}") or {}).get(key), (impls.get(f"tilefuse:{b}") or {}).get(key))
                     for impls in table.values()]
            ratios = [x / y for x, y in pairs if x and y]
            out.setdefault(f"{a}/{b}", {})[mode] = {"geomean time ratio": geomean(ratios),
                                                    f"{b} faster in": sum(r > 1 for r in ratios), "of": len(ratios)}
    return out


def _h20(table: dict) -> list:
    """An H20 (148 TFLOP/s, 4 TB/s) roofline model of both orientations below 64 rows, from the work
    counts alone: the standard kernels (``wgmma``, ``standard``) pad the rows to 64, the transposed
    one does not. Rows: ``[case, padded us, transposed us, gain, the kernel dispatched on an H20]``."""
    from tilefuse.ops.mla import configs

    out = []
    for key, impls in table.items():
        row = next(iter(impls.values()))
        rows_q = row["params"]["h_q"] * row["params"]["s_q"]
        if rows_q >= 64 or "flops" not in row:
            continue
        t_mem = row["bytes"] / (H20["tbps"] * 1e12)
        t_std = max(row["flops"] * 64 / rows_q / (H20["tflops"] * 1e12), t_mem)
        t_tr = max(row["flops"] / (H20["tflops"] * 1e12), t_mem)
        chosen = configs.default_variant(rows_q, 1, True, configs.ridge("H20"))
        out.append((_label(key), round(1e6 * t_std, 1), round(1e6 * t_tr, 1), round(t_std / t_tr, 2), chosen))
    return out


def _accuracy(rows: list[dict]) -> dict:
    acc = [(r["impl"], _label(tuple(r["params"].get(k, 64) for k in ("batch", "h_q", "s_q", "context", "page"))),
            {k: r[k] for k in r if k.startswith(("cos_diff", "rmse"))}) for r in rows if "cos_diff_out" in r]
    return {"pass": bool(acc) and all(a[2]["cos_diff_out"] < 1e-5 and a[2]["cos_diff_lse"] < 1e-5 for a in acc),
            "cases": acc}


def _label(key: tuple) -> str:
    """``(batch, h_q, s_q, context, page)`` as ``b16 h16 s1 4096`` (``, page 16`` where not 64)."""
    batch, h_q, s_q, context, page = key
    return f"b{batch} h{h_q} s{s_q} {context}" + (f", page {page}" if page != 64 else "")
