"""tilefuse.hf.patch_mla and PagedMLACache: transformers' DeepSeek-V2/V3 attention decoding in the
absorbed form over a paged latent cache.

CPU: tiny random models in fp32 (the MLA op's PyTorch reference path): greedy tokens equal to
stock's through ``generate``, one decode step's attention outputs against stock's and an fp64
model, the pages against stock's cached latents, errors. GPU: bf16 on the kernels, agreement with
stock, a decode step captured in a CUDA graph.
"""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilefuse.hf import PagedMLACache, patch_mla, patch_swiglu  # noqa: E402
from tilefuse.hf.mla import MLA_ATTENTION_CLASSES, PagedMLAAttention, mla_softmax_scale  # noqa: E402
from tilefuse.testing import captured, run_without_host_sync  # noqa: E402

# transformers renamed the models' cache argument (``past_key_values`` -> ``cache``) after 5.17;
# pass the one this version's forward takes (the old name still works there, with a warning).
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.DeepseekV3ForCausalLM.forward).parameters \
    else "past_key_values"
VOCAB, PAD = 97, 0


def v3_config(**overrides):
    """A tiny DeepSeek-V3: the op's latent (kv_lora_rank 512, RoPE 64), 4 heads of 32 + 64 / 32,
    a q LoRA of 32, one dense block then MoE blocks (4 experts in 2 groups, 2 per token)."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  max_position_embeddings=512, initializer_range=0.1, pad_token_id=PAD, bos_token_id=1,
                  eos_token_id=2)
    fields.update(overrides)
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    return transformers.DeepseekV3Config(**fields)


def v2_lite_config(**overrides):
    """A tiny DeepSeek-V2-Lite: no q LoRA (plain q_proj), complex-valued RoPE."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=512,
                  q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  max_position_embeddings=512, initializer_range=0.1, pad_token_id=PAD, bos_token_id=1,
                  eos_token_id=2)
    fields.update(overrides)
    return transformers.DeepseekV2Config(**fields)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def stock_and_patched(config, device="cpu", dtype=torch.float32):
    cls = transformers.DeepseekV2ForCausalLM if config.model_type == "deepseek_v2" else \
        transformers.DeepseekV3ForCausalLM
    stock = cls(config).to(device, dtype).eval()
    patched = copy.deepcopy(stock)
    assert patch_mla(patched) == config.num_hidden_layers
    return stock, patched


def prompts(lengths, device="cpu"):
    """Left-padded prompts of the given lengths (``[b, max]`` ids, mask), as a tokenizer pads for generate."""
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), device=device)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def greedy(model, ids, mask, new_tokens, cache=None):
    extra = {CACHE_ARG: cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD, **extra)
    return out[:, ids.shape[1]:]


# ------------------------------------------------------------------------------- greedy tokens


@pytest.mark.parametrize("lengths", [[11], [13, 5, 9]], ids=["batch1", "batch3-left-padded"])
def test_generate_matches_stock(lengths):
    stock, patched = stock_and_patched(v3_config())
    ids, mask = prompts(lengths)
    new = 16
    cache = PagedMLACache(patched, max_batch=4, max_tokens=max(lengths) + new)
    masks = []
    patched.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True)
    expected = greedy(stock, ids, mask, new)
    assert torch.equal(greedy(patched, ids, mask, new, cache), expected)
    assert len(masks) == new and all(m is None for m in masks[1:])      # decode steps build no mask
    # each request holds its own tokens only: prompt (padding excluded) + all but the last new token
    assert cache.cache_seqlens.tolist() == [n + new - 1 for n in lengths] + [0] * (4 - len(lengths))
    assert cache.get_seq_length() == max(lengths) + new - 1


def test_generate_stops_at_eos_per_request():
    """A request that emits EOS stops (then gets padding) while the others go on."""
    stock, patched = stock_and_patched(v3_config())
    ids, mask = prompts([6, 9, 3])
    eos = int(greedy(stock, ids, mask, 4)[1, 1])
    outputs = []
    for model, extra in ((stock, {}), (patched, {CACHE_ARG: PagedMLACache(patched, max_batch=3, max_tokens=32)})):
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                          eos_token_id=eos, pad_token_id=PAD, **extra))
    assert torch.equal(outputs[1], outputs[0])
    assert (outputs[0][1, ids.shape[1]:] == eos).any()


@pytest.mark.parametrize("variant", ["v3-yarn-halves", "v2-lite"])
def test_generate_matches_stock_variants(variant):
    """DeepSeek-V3 with yarn scaling (mscale in the softmax scale) and non-interleaved RoPE;
    DeepSeek-V2-Lite (plain q_proj, complex RoPE)."""
    config = v3_config(rope_parameters=YARN, rope_interleave=False) if variant == "v3-yarn-halves" \
        else v2_lite_config()
    stock, patched = stock_and_patched(config)
    ids, mask = prompts([7, 12, 3])
    cache = PagedMLACache(patched, max_batch=3, max_tokens=40)
    assert torch.equal(greedy(patched, ids, mask, 14, cache), greedy(stock, ids, mask, 14))


def test_generate_with_patch_swiglu_too():
    """patch_swiglu fuses the dense blocks' MLPs and the shared experts beside patch_mla."""
    stock, patched = stock_and_patched(v3_config())
    assert patch_swiglu(patched) == 3        # block 0's MLP, blocks 1-2's shared experts
    ids, mask = prompts([9, 6])
    cache = PagedMLACache(patched, max_batch=2, max_tokens=32)
    assert torch.equal(greedy(patched, ids, mask, 12, cache), greedy(stock, ids, mask, 12))


def test_reset_serves_the_next_batch():
    stock, patched = stock_and_patched(v3_config())
    cache = PagedMLACache(patched, max_batch=3, max_tokens=32)
    addresses = (cache.latent_pages.data_ptr(), cache.block_table.data_ptr(), cache.cache_seqlens.data_ptr())
    for lengths in ([6, 10, 4], [12, 2]):
        ids, mask = prompts(lengths)
        cache.reset()
        assert torch.equal(greedy(patched, ids, mask, 10, cache), greedy(stock, ids, mask, 10))
    # reset works in place: a captured decode step keeps valid addresses
    assert addresses == (cache.latent_pages.data_ptr(), cache.block_table.data_ptr(), cache.cache_seqlens.data_ptr())


def test_other_caches_run_stock_forward():
    """Without a PagedMLACache the patched module is stock: same logits, bit for bit."""
    stock, patched = stock_and_patched(v3_config())
    ids, mask = prompts([8, 5])
    with torch.no_grad():
        for kwargs in ({"use_cache": False}, {"use_cache": True}):
            a = stock(input_ids=ids, attention_mask=mask, **kwargs).logits
            b = patched(input_ids=ids, attention_mask=mask, **kwargs).logits
            assert torch.equal(a, b)
    assert torch.equal(greedy(patched, ids, mask, 6), greedy(stock, ids, mask, 6))
    assert set(patched.state_dict()) == set(stock.state_dict())


# -------------------------------------------------------------------------------------- numerics


def _step_attention(model, cache, ids, mask, step_ids):
    """Prefill ``ids`` then one forward of ``step_ids`` ``[b, s]``; returns every layer's attention
    output ``[b, s, H]`` of that step and its logits."""
    outputs = []
    hooks = [layer.self_attn.register_forward_hook(lambda mod, args, out: outputs.append(out[0]))
             for layer in model.model.layers]
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    step_positions = positions[:, -1:] + 1 + torch.arange(step_ids.shape[1], device=ids.device)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache})
            outputs.clear()
            logits = model(input_ids=step_ids, attention_mask=torch.cat([mask, torch.ones_like(step_ids)], 1),
                           position_ids=step_positions, **{CACHE_ARG: cache}).logits
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


@pytest.mark.parametrize("step_tokens", [1, 3])
def test_decode_step_attention_matches_stock(step_tokens):
    """One decode step's attention outputs (every layer, after o_proj) against stock's.

    Tolerance: the absorbed form computes the same sums as stock's expanded form in another order
    (q_nope W_UK then dots with the 512-wide latent, instead of dots with W_UK c_kv; W_UV after the
    softmax-weighted sum instead of before), so in fp32 the two differ by rounding only. Measured
    against the same model in fp64, patched's error stays within 3x stock's own fp32 error, and
    patched differs from stock by at most 2^-19 of the output's largest magnitude (16 fp32 ulps at
    that scale). Over 30 seeded runs (layers and logits, 1 and 3 tokens) the worst cases were 1.4x
    and 6 ulps. All blocks are dense: the MoE's grouped matmul has no fp64 kernel.
    """
    config = v3_config(num_attention_heads=8, first_k_dense_replace=3)
    stock, patched = stock_and_patched(config)
    exact = copy.deepcopy(stock).double()
    ids, mask = prompts([20, 13, 17])
    step_ids = torch.randint(3, VOCAB, (3, step_tokens))
    ours, ours_logits = _step_attention(patched, PagedMLACache(patched, 3, 64), ids, mask, step_ids)
    theirs, theirs_logits = _step_attention(stock, transformers.DynamicCache(), ids, mask, step_ids)
    truth, truth_logits = _step_attention(exact, transformers.DynamicCache(), ids, mask, step_ids)
    assert len(ours) == len(theirs) == config.num_hidden_layers
    for layer, (a, b, t) in enumerate(zip(ours, theirs, truth)):
        scale = t.abs().max().item()
        ours_err, stock_err = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert ours_err <= 3 * stock_err + 2 ** -24 * scale, (layer, ours_err, stock_err)
        torch.testing.assert_close(a, b, rtol=0, atol=2 ** -19 * scale)
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=2 ** -19 * truth_logits.abs().max().item())


def test_pages_hold_stock_latents():
    """After generate, each request's pages hold what stock's dynamic cache holds for its non-padding
    tokens: kv_a_layernorm(c_kv) then the RoPE'd k_pe. The prompt's rows are stock's own tensors
    (the prefill runs stock's forward); the decoded ones are computed by the patched path."""
    stock, patched = stock_and_patched(v3_config())
    lengths, new = [10, 4, 7], 6
    ids, mask = prompts(lengths)
    cache = PagedMLACache(patched, max_batch=3, max_tokens=24)
    tokens = greedy(patched, ids, mask, new, cache)
    full = torch.cat([ids, tokens[:, :-1]], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], 1)
    reference = transformers.DynamicCache()
    with torch.no_grad():
        stock(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0),
              **{CACHE_ARG: reference})
        for i in range(new - 1):   # one token at a time, as generate fed the patched model
            width = ids.shape[1] + i
            stock(input_ids=full[:, width:width + 1], attention_mask=full_mask[:, :width + 1],
                  position_ids=full_mask[:, :width + 1].cumsum(1)[:, -1:] - 1, **{CACHE_ARG: reference})
    for layer in range(3):
        stored = reference.layers[layer]
        latents = torch.cat([stored.keys[:, 0], stored.values[:, 0]], -1)            # [b, tokens, 576]
        for row, n in enumerate(lengths):
            mine = cache.k_cache(layer)[cache.block_table[row].long()].reshape(-1, 576)[:n + new - 1]
            theirs = latents[row][full_mask[row] == 1]
            assert torch.equal(mine[:n], theirs[:n])
            torch.testing.assert_close(mine[n:], theirs[n:], rtol=1e-5, atol=1e-5)


def test_long_step_runs_in_chunks():
    """A 70-token forward after the prefill at 8 heads: the op takes 512 // 8 = 64 tokens per call,
    so it runs as 64 + 6, each chunk seeing the keys before it (logits against stock's)."""
    stock, patched = stock_and_patched(v3_config(num_attention_heads=8, first_k_dense_replace=3))
    ids, mask = prompts([9, 5])
    more = torch.randint(3, VOCAB, (2, 70))
    more_mask = torch.cat([mask, torch.ones_like(more)], 1)
    positions = (more_mask.cumsum(1) - 1).clamp_min(0)
    logits = []
    for model, cache in ((stock, transformers.DynamicCache()), (patched, PagedMLACache(patched, 2, 80))):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions[:, :9], **{CACHE_ARG: cache})
            logits.append(model(input_ids=more, attention_mask=more_mask, position_ids=positions[:, 9:],
                                **{CACHE_ARG: cache}).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=2 ** -19 * logits[0].abs().max().item())


def test_softmax_scale_is_the_models():
    for config in (v3_config(), v3_config(rope_parameters=YARN), v2_lite_config()):
        stock, patched = stock_and_patched(config)
        attn = stock.model.layers[0].self_attn
        assert mla_softmax_scale(config) == pytest.approx(attn.scaling, rel=1e-12)
        assert patched.model.layers[0].self_attn._mla_scale == attn.scaling
    assert mla_softmax_scale(v3_config(rope_parameters=YARN)) > (32 + 64) ** -0.5     # mscale^2 > 1


# ---------------------------------------------------------------------------------------- errors


class FakeFlashMLA:
    """A module with FlashMLA's API over tilefuse's op (the reference path on a CPU), counting its
    calls. ``lazy``: main's API, ``get_mla_metadata`` returning an empty schedule object (and None)
    that the first attention call fills and later calls must reuse with the same lengths."""

    def __init__(self, lazy: bool):
        import tilefuse

        self.op, self.lazy, self.metadata_calls, self.attention_calls = tilefuse, lazy, 0, 0

    def get_mla_metadata(self, cache_seqlens, rows, heads_k):
        self.metadata_calls += 1
        if self.lazy:
            return {"args": (cache_seqlens, rows, heads_k)}, None
        return self.op.get_mla_metadata(cache_seqlens, rows, heads_k)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits, **kwargs):
        self.attention_calls += 1
        if self.lazy:
            assert splits is None and meta["args"][0] is cache_seqlens
            if "plan" not in meta:                 # the first layer of the step plans, the rest reuse
                meta["plan"] = self.op.get_mla_metadata(*meta["args"])
            meta, splits = meta["plan"]
        return self.op.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                                              **kwargs)


@pytest.mark.parametrize("lazy", [False, True], ids=["b31bfe7-api", "main-api"])
def test_patch_mla_calls_the_given_attention(lazy):
    """patch_mla(attention=) decodes through any module with FlashMLA's API: it is called in every
    layer of every decode step, its schedule planned once per step for all layers, and the greedy
    tokens are tilefuse's own (and stock's)."""
    from tilefuse.hf.mla import attention_of
    from tilefuse.ops.mla import op

    stock, ours = stock_and_patched(v3_config())
    peer_model = copy.deepcopy(stock)
    fake = FakeFlashMLA(lazy)
    assert patch_mla(peer_model, attention=fake) == 3
    assert attention_of(peer_model) is fake and attention_of(ours) is op and attention_of(stock) is None
    lengths, new = [13, 5, 9], 6
    ids, mask = prompts(lengths)
    tokens = greedy(ours, ids, mask, new, PagedMLACache(ours, max_batch=3, max_tokens=max(lengths) + new))
    peer = greedy(peer_model, ids, mask, new, PagedMLACache(peer_model, max_batch=3, max_tokens=max(lengths) + new))
    assert torch.equal(peer, tokens) and torch.equal(tokens, greedy(stock, ids, mask, new))
    # the prefill runs stock attention; each of the new - 1 decode steps plans once, attends in 3 layers
    assert (fake.metadata_calls, fake.attention_calls) == (new - 1, 3 * (new - 1))
    # a second call patches nothing and switches the implementation back to tilefuse's
    assert patch_mla(peer_model) == 0 and attention_of(peer_model) is op


def test_patch_errors():
    with pytest.raises(ValueError, match="model_type"):
        patch_mla(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        patch_mla(transformers.DeepseekV3ForCausalLM(v3_config(kv_lora_rank=256, num_hidden_layers=1)))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        patch_mla(transformers.DeepseekV3ForCausalLM(v3_config(qk_rope_head_dim=32, num_hidden_layers=1)))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        PagedMLACache(v2_lite_config(kv_lora_rank=128), 1, 16)
    stock, patched = stock_and_patched(v3_config(num_hidden_layers=1))
    assert patch_mla(patched) == 0                                  # idempotent
    for bad in (object(), "flash_mla", torch):                      # no FlashMLA API
        with pytest.raises(ValueError, match="attention: expected None .* get_mla_metadata"):
            patch_mla(patched, attention=bad)
    assert isinstance(patched.model.layers[0].self_attn, PagedMLAAttention)
    assert set(MLA_ATTENTION_CLASSES) == {"deepseek_v2", "deepseek_v3"}


def test_cache_errors():
    stock, patched = stock_and_patched(v3_config(num_hidden_layers=1))
    for kwargs, name in (({"max_batch": 0, "max_tokens": 8}, "max_batch"),
                         ({"max_batch": 2, "max_tokens": 0}, "max_tokens"),
                         ({"max_batch": 2.0, "max_tokens": 8}, "max_batch"),
                         ({"max_batch": 2, "max_tokens": 8, "dtype": torch.int32}, "dtype")):
        with pytest.raises(ValueError, match=name):
            PagedMLACache(patched, **kwargs)
    ids, mask = prompts([6, 4])
    with pytest.raises(ValueError, match="max_tokens"):             # 6 + 7 tokens do not fit 12
        greedy(patched, ids, mask, 8, PagedMLACache(patched, max_batch=2, max_tokens=12))
    with pytest.raises(ValueError, match="max_batch"):
        greedy(patched, ids, mask, 2, PagedMLACache(patched, max_batch=1, max_tokens=16))
    with pytest.raises(ValueError, match="past_key_values"):        # the model computes fp32
        greedy(patched, ids, mask, 2, PagedMLACache(patched, max_batch=2, max_tokens=16, dtype=torch.float64))
    with pytest.raises(ValueError, match="past_key_values"):        # a model without patch_mla
        greedy(stock, ids, mask, 2, PagedMLACache(stock, max_batch=2, max_tokens=16))
    with pytest.raises(ValueError, match="num_beams"):
        with torch.no_grad():
            patched.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False,
                             pad_token_id=PAD, **{CACHE_ARG: PagedMLACache(patched, max_batch=4, max_tokens=16)})
    with pytest.raises(ValueError, match="attention_mask"):
        with torch.no_grad():
            patched(input_ids=ids, attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool),
                    **{CACHE_ARG: PagedMLACache(patched, max_batch=2, max_tokens=16)})


# ------------------------------------------------------------------------------------------- GPU


def _forced_agreement(stock, prompt, mask, tokens):
    """Fraction of ``tokens`` that stock's full forward over prompt + tokens picks too (teacher forced)."""
    ids = torch.cat([prompt, tokens[:, :-1]], 1)
    full = torch.cat([mask, torch.ones_like(tokens[:, :-1])], 1)
    with torch.no_grad():
        logits = stock(input_ids=ids, attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp_min(0),
                       use_cache=False, logits_to_keep=tokens.shape[1]).logits
    return (logits.argmax(-1) == tokens).float().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_bf16_generate_agrees_with_stock(heads):
    """bf16 on the kernels: patched's greedy tokens are what stock's own full forward picks at least
    as often as stock's incremental decode agrees with itself (its bf16 self-consistency), less 0.03."""
    config = v3_config(num_attention_heads=heads, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=4)
    stock, patched = stock_and_patched(config, "cuda", torch.bfloat16)
    ids, mask = prompts([100, 37, 64, 80], "cuda")
    cache = PagedMLACache(patched, max_batch=4, max_tokens=100 + 32)
    ours, theirs = greedy(patched, ids, mask, 32, cache), greedy(stock, ids, mask, 32)
    self_consistency = _forced_agreement(stock, ids, mask, theirs)
    assert _forced_agreement(stock, ids, mask, ours) >= min(self_consistency, 0.97) - 0.03


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_step_attention_close_to_stock(heads):
    """bf16 on the kernels, one decode step's attention outputs against the same model in fp32:
    patched's error within 3x stock bf16's own, plus one bf16 rounding (2^-8) of the output scale
    (both forms round q, the keys' or the latent query, the probabilities and the output to bf16
    at different points)."""
    config = v3_config(num_attention_heads=heads, hidden_size=256, num_hidden_layers=2, first_k_dense_replace=2)
    stock, patched = stock_and_patched(config, "cuda", torch.bfloat16)
    exact = copy.deepcopy(stock).float()
    ids, mask = prompts([300, 129, 64], "cuda")
    step_ids = torch.randint(3, VOCAB, (3, 1), device="cuda")
    ours, _ = _step_attention(patched, PagedMLACache(patched, 3, 320), ids, mask, step_ids)
    theirs, _ = _step_attention(stock, transformers.DynamicCache(), ids, mask, step_ids)
    truth, _ = _step_attention(exact, transformers.DynamicCache(), ids, mask, step_ids)
    for a, b, t in zip(ours, theirs, truth):
        ours_err, stock_err = (a.float() - t).abs().max().item(), (b.float() - t).abs().max().item()
        assert ours_err <= 3 * stock_err + 2 ** -8 * t.abs().max().item(), (ours_err, stock_err)


@pytest.mark.gpu
def test_gpu_decode_step_captured_in_cuda_graph():
    """A DeepSeek-V3-shaped decode step (dense blocks, 16 heads) with the paged cache: no host sync,
    captured once, replayed per token: the same tokens as the eager steps."""
    config = v3_config(num_attention_heads=16, hidden_size=256, num_hidden_layers=2, first_k_dense_replace=2)
    _, model = stock_and_patched(config, "cuda", torch.bfloat16)
    batch, prompt_len, new = 3, 70, 12
    ids = torch.randint(3, VOCAB, (batch, prompt_len), device="cuda")
    cache = PagedMLACache(model, max_batch=batch, max_tokens=prompt_len + 2 * new + 8)
    token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")

    def prefill():
        cache.reset()
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_ARG: cache}).logits
        token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        position.fill_(prompt_len)

    def step():
        logits = model(input_ids=token, position_ids=position, use_cache=True, logits_to_keep=1,
                       **{CACHE_ARG: cache}).logits
        token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        position.add_(1)

    with torch.no_grad():
        prefill()
        step()                                  # compiles the kernels, fills the workspaces
        run_without_host_sync(step)
        prefill()
        eager = []
        for _ in range(new):
            step()
            eager.append(token.clone())
        prefill()
        graph, _ = captured(step)
        prefill()
        replayed = []
        for _ in range(new):
            graph.replay()
            replayed.append(token.clone())
    assert torch.equal(torch.cat(replayed, 1), torch.cat(eager, 1))


def _rows_case(mode, batch, q_len, heads, dtype, device, seed):
    """The projections of a decode step as ``PagedMLAAttention`` holds them (views of q and kv
    projections), the model's rotations for ``mode``, distinct cache slots and NaN pages."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch * q_len
    q = torch.randn(batch, q_len, heads * 192, generator=gen).to(dtype).view(batch, q_len, heads, 192)
    kv = torch.randn(batch, q_len, 576, generator=gen).to(dtype)
    c_kv = torch.randn(batch, q_len, 512, generator=gen).to(dtype)
    q_lat = torch.randn(heads, rows, 512, generator=gen).to(dtype)
    angles = torch.rand(batch, q_len, 32, generator=gen, dtype=torch.float64) * 40
    if mode == "complex":
        rotations = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    else:
        twice = torch.cat((angles, angles), dim=-1)
        rotations = (twice.cos().to(dtype), twice.sin().to(dtype))
    slots = torch.randperm(5 * 64, generator=gen)[:rows]
    pages = torch.full((5, 64, 1, 576), float("nan"), dtype=dtype)
    out = (q_lat, q[..., 128:], kv[..., 512:], c_kv, rotations, slots, pages)
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else tuple(r.to(device) for r in t) for t in out)


@pytest.mark.parametrize("mode", ["pairs", "halves", "complex"])
@pytest.mark.parametrize("batch,q_len,heads", [(2, 1, 3), (1, 3, 16), (3, 2, 5)])
def test_decode_rows_kernel_is_the_rotations_and_the_cache_write(interpret, mode, batch, q_len, heads):
    """``ops.mla.kv.decode_rows`` (one launch per decode step and layer) gives the query and the
    cache rows that the patched attention's PyTorch ops give: RoPE of DeepSeek-V3 (interleaved
    pairs or halves, rounded to the 16-bit dtype op by op as PyTorch rounds) and of DeepSeek-V2
    (complex rotations in fp32), the absorbed 512 values, rows at the slots and nowhere else.
    Bit-exact in the interpreter (no fused multiply-adds); on a GPU within one 16-bit rounding."""
    from tilefuse.hf.mla import _decode_rows, _rotate

    q_lat, q_pe, k_pe, c_kv, rotations, slots, pages = _rows_case(mode, batch, q_len, heads, torch.float16,
                                                                  interpret, seed=batch * 100 + q_len * 10 + heads)
    expect_pages = pages.clone()
    rq, rk = _rotate(q_pe, k_pe[:, :, None], rotations, mode == "pairs")
    expect_pages.view(-1, 576).index_copy_(0, slots, torch.cat((c_kv, rk[:, :, 0]), dim=-1).reshape(-1, 576))
    expect_q = torch.cat((q_lat.view(heads, batch, q_len, 512).permute(1, 2, 0, 3), rq), dim=-1)
    q = _decode_rows(q_lat, q_pe, k_pe, c_kv, rotations, mode == "pairs", slots, pages)
    assert q is not None and q.shape == (batch, q_len, heads, 576)
    exact = interpret.type == "cpu"
    tol = dict(atol=0, rtol=0) if exact else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(q, expect_q, **tol)
    torch.testing.assert_close(pages, expect_pages, equal_nan=True, **tol)      # untouched rows stay NaN


def test_decode_rows_refuses_what_it_cannot_address():
    """The PyTorch path stays where the kernel would not run: the reference backend, fp32, cos and
    sin in another dtype than the query (PyTorch would promote), rotations broadcast over the
    batch (one row stride could not address them)."""
    from tilefuse import force
    from tilefuse.hf.mla import _decode_rows

    q_lat, q_pe, k_pe, c_kv, rotations, slots, pages = _rows_case("pairs", 2, 1, 3, torch.float16, "cpu", seed=1)
    with force(backend="reference"):
        assert _decode_rows(q_lat, q_pe, k_pe, c_kv, rotations, True, slots, pages) is None
    cos, sin = rotations
    assert _decode_rows(q_lat, q_pe, k_pe, c_kv, (cos.float(), sin.float()), True, slots, pages) is None
    shared = (cos[:1], sin[:1])                                        # one row of angles for the batch
    assert _decode_rows(q_lat, q_pe, k_pe, c_kv, shared, True, slots, pages) is None
    args = [t.float() for t in (q_lat, q_pe, k_pe, c_kv)]
    assert _decode_rows(*args, (cos.float(), sin.float()), True, slots, pages.float()) is None
