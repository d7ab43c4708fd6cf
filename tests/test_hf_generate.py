"""tilefuse.hf.generate: the decode loop on static buffers (a CUDA graph on the GPU) against
``model.generate``.

CPU (the loop uncaptured, fp32): greedy tokens equal to ``model.generate``'s for tiny Llama /
Qwen2 models and a tiny DeepSeek-V3 (stock, and patched by ``patch_mla`` over its paged cache),
batches of left-padded prompts, EOS in the middle of a batch, repeated calls (the cached
generator's buffers reset); sampling reproducible by seed, top-k 1 equal to greedy; errors. GPU:
the captured loop equals the uncaptured one (greedy, padded batch) and issues no host sync per
token.
"""


import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilefuse.hf  # noqa: E402
from tilefuse.bench import hf_models  # noqa: E402
from tilefuse.hf import decode  # noqa: E402
from tests.test_hf_mla import VOCAB, prompts as left_padded  # noqa: E402  (left-padded ids and mask)



def tiny(arch="llama", impl="sdpa", device="cpu", dtype=torch.float32):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = transformers.Qwen2Config(**common) if arch == "qwen2" else transformers.LlamaConfig(**common)
    config._attn_implementation = impl
    return hf_models.random_model(config, torch.device(device), dtype)


def stock_generate(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
@pytest.mark.parametrize("lengths", [[9], [9, 4, 7]])
def test_greedy_equals_model_generate(arch, impl, lengths):
    torch.manual_seed(0)
    model = tiny(arch, impl)
    ids, mask = left_padded(lengths)
    want = stock_generate(model, ids, mask, 10, eos_token_id=None)
    for _ in range(2):           # the second call reuses the generator: its buffers reset
        got = tilefuse.hf.generate(model, ids, 10, attention_mask=mask, eos_token_id=None, pad_token_id=0)
        assert torch.equal(got, want)


def test_eos_mid_batch_pads_and_cuts_as_model_generate():
    torch.manual_seed(1)
    model = tiny()
    ids, mask = left_padded([8, 5, 6])
    free = stock_generate(model, ids, mask, 12, eos_token_id=None)[:, 8:]
    eos = int(free[1, 3])                         # a token the second request emits early on
    want = stock_generate(model, ids, mask, 12, eos_token_id=eos)
    got = tilefuse.hf.generate(model, ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0,
                               check_every=2)
    assert torch.equal(got, want)
    assert (got[1, 8:] == 0).any()                # padded after its EOS
    # every request ending early: cut after the last EOS, as generate does
    every = int(free[0, 0])
    want = stock_generate(model, ids, mask, 12, eos_token_id=[every, eos])
    got = tilefuse.hf.generate(model, ids, 12, attention_mask=mask, eos_token_id=[every, eos], pad_token_id=0)
    assert torch.equal(got, want)


def test_deepseek_stock_and_patched_mla_equal_model_generate():
    from tests.test_hf_mla import prompts, stock_and_patched, v3_config

    torch.manual_seed(2)
    stock, patched = stock_and_patched(v3_config())
    ids, mask = prompts([7, 3, 5])
    want = stock_generate(stock, ids, mask, 8, eos_token_id=None)
    assert torch.equal(tilefuse.hf.generate(stock, ids, 8, attention_mask=mask, eos_token_id=None), want)
    gen = tilefuse.hf.generate(patched, ids, 8, attention_mask=mask, eos_token_id=None)
    assert torch.equal(gen, want)
    assert patched._tilefuse_generators and all(g.paged for g in patched._tilefuse_generators.values())


def test_generators_are_shared_by_nearby_lengths_and_few_are_kept():
    """Calls whose prompt + new tokens round to the same cache length share one generator (its
    cache and graph); at most GENERATORS_PER_MODEL are kept, the least recently used dropped."""
    model = tiny()
    ids = torch.randint(3, VOCAB, (2, 20))
    tilefuse.hf.generate(model, ids, 5, eos_token_id=None)
    tilefuse.hf.generate(model, ids[:, :9], 30, eos_token_id=None)
    assert len(model._tilefuse_generators) == 1
    first = next(iter(model._tilefuse_generators.values()))
    assert first.max_len == decode.CAPACITY_STEP
    for batch in (3, 4, 5):
        tilefuse.hf.generate(model, torch.randint(3, VOCAB, (batch, 8)), 4, eos_token_id=None)
    kept = model._tilefuse_generators
    assert len(kept) == decode.GENERATORS_PER_MODEL and [k[0] for k in kept] == [4, 5]
    long = torch.randint(3, VOCAB, (2, decode.CAPACITY_STEP))
    assert tilefuse.hf.generate(model, long, 3, eos_token_id=None).shape == (2, decode.CAPACITY_STEP + 3)
    assert max(g.max_len for g in kept.values()) == 2 * decode.CAPACITY_STEP


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    torch.manual_seed(3)
    model = tiny()
    ids, mask = left_padded([6, 6])
    a = tilefuse.hf.generate(model, ids, 12, do_sample=True, seed=5, temperature=1.5, top_p=0.9, eos_token_id=None)
    b = tilefuse.hf.generate(model, ids, 12, do_sample=True, seed=5, temperature=1.5, top_p=0.9, eos_token_id=None)
    c = tilefuse.hf.generate(model, ids, 12, do_sample=True, seed=6, temperature=1.5, top_p=0.9, eos_token_id=None)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = tilefuse.hf.generate(model, ids, 12, eos_token_id=None)
    assert torch.equal(tilefuse.hf.generate(model, ids, 12, do_sample=True, top_k=1, seed=7, eos_token_id=None),
                       greedy)


def test_sampling_follows_the_filtered_distribution():
    """Gumbel-max over top-k / top-p filtered logits: tokens outside the kept set never appear, the
    kept ones with their softmax frequencies (4000 draws, 5 sigma)."""
    model = tiny()
    gen = decode.Generator(model, 4000, 8, sampling=(1.0, 3, None), eos=(), pad=0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.4, -1.0]]).expand(4000, 5).contiguous()
    gen.noise = torch.empty(4000, 5)
    gen.generator.manual_seed(0)
    gen._draw()
    tok = gen._pick(logits)
    counts = torch.bincount(tok, minlength=5).double()
    assert counts[3:].sum() == 0
    p = logits[0, :3].softmax(-1).double()
    assert ((counts[:3] / 4000 - p).abs() <= 5 * (p * (1 - p) / 4000).sqrt()).all(), counts
    gen.sampling = (1.0, None, 0.5)         # top-p 0.5: the first token alone reaches it
    gen.finished.zero_()
    assert (gen._pick(logits) == 0).all()


@pytest.mark.parametrize("call,match", [
    (lambda m, ids: tilefuse.hf.generate(m, ids.int(), 4), "input_ids: expected a \\[batch, prompt\\] int64"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 0), "max_new_tokens"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, attention_mask=torch.ones(1, 3)), "attention_mask: expected shape"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, attention_mask=torch.tensor([[1, 1, 1, 1, 0]] * 2)),
     "left padding"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, do_sample=True, temperature=0), "temperature"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, do_sample=True, top_p=1.5), "top_p"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, do_sample=True, top_k=0), "top_k"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, cuda_graph=True), "cuda_graph"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, check_every=0), "check_every"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, eos_token_id="</s>"), "eos_token_id: expected token ids"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, eos_token_id=[2, "x"]), "eos_token_id"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, eos_token_id=2.0), "eos_token_id"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, eos_token_id=torch.tensor(2.0)), "eos_token_id"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, eos_token_id=-3), "eos_token_id"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, pad_token_id=[0, 1]), "pad_token_id"),
    (lambda m, ids: tilefuse.hf.generate(m, ids, 4, pad_token_id="<pad>"), "pad_token_id"),
    (lambda m, ids: tilefuse.hf.generate(object(), ids, 4), "model: expected a Hugging Face causal LM"),
    (lambda m, ids: tilefuse.hf.generate(torch.nn.Linear(4, 4), ids, 4), "model: expected a Hugging Face"),
    (lambda m, ids: tilefuse.hf.generate(m.state_dict(), ids, 4), "model: expected .*got OrderedDict"),
])
def test_errors_name_the_argument(call, match):
    model = tiny()
    ids = torch.randint(3, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=match):
        call(model, ids)


def test_eos_token_id_forms_agree():
    """``eos_token_id`` as an int, a 0-d tensor, a 1-d tensor, a list or a tuple (of ints or 0-d
    tensors) ends sequences alike (before: a 0-d tensor raised TypeError from ``list()``), and a
    0-d ``pad_token_id`` pads as its int."""
    torch.manual_seed(1)
    model = tiny()
    ids, mask = left_padded([8, 5, 6])
    free = tilefuse.hf.generate(model, ids, 12, attention_mask=mask, eos_token_id=None, pad_token_id=0)[:, 8:]
    eos = int(free[1, 3])
    want = tilefuse.hf.generate(model, ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    for form in (torch.tensor(eos), torch.tensor([eos]), [eos], (torch.tensor(eos),)):
        got = tilefuse.hf.generate(model, ids, 12, attention_mask=mask, eos_token_id=form,
                                   pad_token_id=torch.tensor(0))
        assert torch.equal(got, want), form


def test_padded_batches_need_a_mask_taking_attention():
    model = tiny(impl="eager")
    model.config._attn_implementation = "flex_attention"
    ids, mask = left_padded([5, 3])
    with pytest.raises(ValueError, match="attn_implementation"):
        tilefuse.hf.generate(model, ids, 4, attention_mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_captured_loop_equals_the_uncaptured_one_without_host_sync(dtype):
    from tilefuse.testing import run_without_host_sync

    torch.manual_seed(4)
    model = tiny(device="cuda", dtype=dtype)
    ids, mask = left_padded([12, 7, 9], device="cuda")
    plain = tilefuse.hf.generate(model, ids, 24, attention_mask=mask, eos_token_id=None, cuda_graph=False)
    graphed = tilefuse.hf.generate(model, ids, 24, attention_mask=mask, eos_token_id=None)
    assert torch.equal(graphed, plain)
    if dtype == torch.float32:
        assert torch.equal(graphed, stock_generate(model, ids, mask, 24, eos_token_id=None))
    gen = next(g for k, g in model._tilefuse_generators.items() if k[-1])
    assert gen.graph is not None
    with torch.no_grad():
        gen.prefill(ids, mask)          # then replays within the cache's length, as run() issues them
        run_without_host_sync(lambda: [gen.graph.replay() for _ in range(8)])
    # sampling under the graph: reproducible by seed
    a = tilefuse.hf.generate(model, ids, 16, do_sample=True, seed=1, top_k=20, eos_token_id=None)
    b = tilefuse.hf.generate(model, ids, 16, do_sample=True, seed=1, top_k=20, eos_token_id=None)
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[9, 9, 9], [9, 4, 6]])
def test_gpu_patched_deepseek_graph_decode_equals_its_eager_generate(lengths):
    """bf16 on the MLA kernels: the captured loop over the paged cache gives the tokens of the same
    patched model's own ``generate`` over a PagedMLACache (the same kernels, run eagerly)."""
    from tests.test_hf_mla import CACHE_ARG, prompts, stock_and_patched, v3_config

    from tilefuse.hf import PagedMLACache

    torch.manual_seed(5)
    config = v3_config(num_attention_heads=16, hidden_size=256, num_hidden_layers=2, first_k_dense_replace=2)
    _, patched = stock_and_patched(config, device="cuda", dtype=torch.bfloat16)
    ids, mask = prompts(lengths, device="cuda")
    cache = PagedMLACache(patched, max_batch=len(lengths), max_tokens=max(lengths) + 12)
    want = stock_generate(patched, ids, mask, 12, eos_token_id=None, **{CACHE_ARG: cache})
    plain = tilefuse.hf.generate(patched, ids, 12, attention_mask=mask, eos_token_id=None, cuda_graph=False)
    got = tilefuse.hf.generate(patched, ids, 12, attention_mask=mask, eos_token_id=None)
    assert torch.equal(plain, want), (plain[:, -12:], want[:, -12:])
    assert torch.equal(got, want), (got[:, -12:], want[:, -12:])
