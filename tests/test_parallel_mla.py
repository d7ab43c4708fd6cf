"""Tensor-parallel DeepSeek-V2/V3 models decoding through tilefuse.hf.patch_mla and PagedMLACache.

Each rank holds ``num_heads / world_size`` query heads: ``q_b_proj`` (``q_proj``) and ``kv_b_proj``
cut by rows, ``o_proj`` row-parallel (one all-reduce), the latent path replicated and each rank
caching the whole latent in its own PagedMLACache. Two routes: a full model cut by
``tilefuse.parallel.shard_model`` (before or after ``patch_mla``), and a checkpoint loaded by
transformers with ``tp_plan="auto"`` then patched by ``tilefuse.parallel.hf.patch_mla``.

CPU, two processes (gloo), fp32 on the MLA op's PyTorch reference path, tiny random models (4 heads,
2 per rank): the prefill's and decode steps' logits equal the one-process patched model's, and the
greedy (and seeded sampled) tokens of ``model.generate`` and ``tilefuse.hf.generate`` equal it too.

Tolerance of the logits: the two sides compute the same products; they differ in the order of the
sums that the split cuts (o_proj's and the MLP down projection's K split in two partial sums, then
the all-reduce) and nothing else, a few fp32 roundings per block: measured 0.6-2.1e-6 of the
logits' largest magnitude; the bound is 2^-16 (1.5e-5) of it, while a head cut or summed wrongly
moves the logits by O(1).

Two GPUs (NCCL, ``-m gpu``): ``tilefuse.hf.generate`` with the decode step captured in a CUDA graph
on every rank, bf16, against the one-GPU model's tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")


VOCAB, PAD = 96, 0
LOGITS_TOL = 2.0 ** -16          # of the largest |logit| (module docstring)
PROMPTS = [7, 11, 4]             # left-padded prompt lengths of the batch


def config_of(variant: str, heads: int = 4):
    """Tiny DeepSeek configs with the op's latent (KV LoRA 512, RoPE 64) and 4 heads; weights of
    std 0.3, whose greedy tokens vary (at 0.1 they repeat one token).

    * ``v3-dense``: DeepSeek-V3, q LoRA, 2 dense blocks (the benchmark's layout);
    * ``v3-moe``: one dense block then 2 MoE blocks (shared expert cut, routed experts replicated);
    * ``v2-lite``: DeepSeek-V2-Lite (plain ``q_proj``, complex RoPE), one dense and one MoE block.
    """
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4,
                  num_experts_per_tok=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                  v_head_dim=32, max_position_embeddings=256, initializer_range=0.3, pad_token_id=PAD,
                  bos_token_id=1, eos_token_id=2)
    if variant == "v2-lite":
        return transformers.DeepseekV2Config(**common, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None)
    layers, dense = (2, 2) if variant == "v3-dense" else (3, 1)
    return transformers.DeepseekV3Config(**common, num_hidden_layers=layers, first_k_dense_replace=dense,
                                         q_lora_rank=32, n_group=2, topk_group=1)


def model_of(config) -> torch.nn.Module:
    torch.manual_seed(0)             # the same full model on every rank
    cls = transformers.DeepseekV2ForCausalLM if config.model_type == "deepseek_v2" else \
        transformers.DeepseekV3ForCausalLM
    return cls(config).eval()


def prompts(lengths=PROMPTS):
    gen = torch.Generator().manual_seed(5)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def _cache_arg(model) -> str:
    from tilefuse.hf.decode import cache_argument

    return cache_argument(model)


def step_logits(model, ids, mask, steps) -> list[torch.Tensor]:
    """Logits of the prefill of ``ids`` and of each decode step of ``steps`` (``[b, s]`` token
    blocks, 1 or more tokens each) over a fresh PagedMLACache."""
    from tilefuse.hf import PagedMLACache

    cache = PagedMLACache(model, max_batch=ids.shape[0], max_tokens=64)
    arg = _cache_arg(model)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=positions, **{arg: cache}).logits]
    last = positions[:, -1:]
    for block in steps:
        pos = last + 1 + torch.arange(block.shape[1], device=ids.device)
        out.append(model(input_ids=block, position_ids=pos, **{arg: cache}).logits)
        last = pos[:, -1:]
    return out


def decode_all(model, ids, mask, new: int = 10) -> dict:
    """Greedy tokens through model.generate + PagedMLACache and through tilefuse.hf.generate,
    and seeded sampled tokens of tilefuse.hf.generate."""
    import tilefuse.hf
    from tilefuse.hf import PagedMLACache

    cache = PagedMLACache(model, max_batch=ids.shape[0], max_tokens=ids.shape[1] + new)
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=PAD, **{_cache_arg(model): cache})[:, ids.shape[1]:]
    ours = tilefuse.hf.generate(model, ids, new, attention_mask=mask, eos_token_id=[], pad_token_id=PAD)
    sampled = tilefuse.hf.generate(model, ids, new, attention_mask=mask, do_sample=True, top_k=20, seed=11,
                                   eos_token_id=[], pad_token_id=PAD)
    return {"hf": hf, "generate": ours[:, ids.shape[1]:], "sampled": sampled[:, ids.shape[1]:]}


def compare(one: torch.nn.Module, tp: torch.nn.Module) -> dict:
    """Logits of a prefill and two decode steps (1 and 3 tokens), and the decoded tokens, of the
    tensor-parallel model against the one-process model (both on the same device)."""
    device = next(tp.parameters()).device
    ids, mask = (t.to(device) for t in prompts())
    gen = torch.Generator().manual_seed(6)
    steps = [torch.randint(3, VOCAB, (ids.shape[0], n), generator=gen).to(device) for n in (1, 3)]
    want, got = step_logits(one, ids, mask, steps), step_logits(tp, ids, mask, steps)
    errors = [float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
    tokens_one, tokens_tp = decode_all(one, ids, mask), decode_all(tp, ids, mask)
    # sampling without a seed: each rank draws one from its own generator, seeded apart here;
    # tilefuse.hf.generate takes rank 0's, so the ranks still decode the same tokens
    import tilefuse.hf

    torch.manual_seed(1000 + dist.get_rank())
    unseeded = tilefuse.hf.generate(tp, ids, 6, attention_mask=mask, do_sample=True, eos_token_id=[], pad_token_id=PAD)
    return {"unseeded": unseeded.tolist(),"logit_errors": errors,
            "tokens_equal": {k: bool(torch.equal(tokens_tp[k], tokens_one[k])) for k in tokens_one},
            "greedy_is_hf": bool(torch.equal(tokens_one["generate"], tokens_one["hf"])),
            "tokens": tokens_tp["generate"].tolist()}


# ----------------------------------------------------------------------------- jobs run on every rank
@torch.no_grad()
def job_shard_model(variant: str, order: str, lm_head: bool) -> dict:
    """shard_model (``lm_head``: cut by the vocabulary too) and patch_mla (in ``order``) on a full
    model, against patch_mla alone."""
    from tilefuse.hf import patch_mla
    from tilefuse.parallel import ParallelSwiGLUMLP, RowParallel, shard_model

    config = config_of(variant)
    full = model_of(config)
    one = copy.deepcopy(full)
    patch_mla(one)
    tp = full
    if order == "shard-then-patch":
        replaced = shard_model(tp, lm_head=lm_head)
        patch_mla(tp)
    else:
        patch_mla(tp)
        replaced = shard_model(tp, lm_head=lm_head)
    attn = tp.model.layers[0].self_attn
    heads = attn.kv_b_proj.weight.shape[0] // (config.qk_nope_head_dim + config.v_head_dim)
    out = compare(one, tp)
    out.update(replaced=replaced, local_heads=heads, o_proj=type(attn.o_proj).__name__,
               mlp=type(tp.model.layers[0].mlp).__name__)
    assert isinstance(attn.o_proj, RowParallel) and isinstance(tp.model.layers[0].mlp, ParallelSwiGLUMLP)
    return out


@torch.no_grad()
def job_tp_plan(path: str, swiglu: bool) -> dict:
    """A checkpoint loaded with tp_plan="auto", patched by tilefuse.parallel.hf.patch_mla (and
    patch_swiglu), against the one-process model patched by tilefuse.hf.patch_mla (and patch_swiglu)."""
    import tilefuse.hf
    import tilefuse.parallel.hf as tp_hf

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()

    try:                 # the one-device patch refuses the DTensor weights (its decode slices kv_b_proj per head)
        tilefuse.hf.patch_mla(load())
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    tp = load()
    one = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded_tp = tp_hf.is_tensor_parallel(tp)
    patched = tp_hf.patch_mla(tp)
    tilefuse.hf.patch_mla(one)
    if swiglu:
        tp_hf.patch_swiglu(tp)
        tilefuse.hf.patch_swiglu(one)
    out = compare(one, tp)
    attn = tp.model.layers[0].self_attn
    out.update(patched=patched, loaded_tp=loaded_tp, refused=refused,
               dtensors_left=tp_hf.is_tensor_parallel(attn), local_heads=attn.kv_b_proj.weight.shape[0] // 64)
    return out


# ----------------------------------------------------------------------------- CPU, 2 processes
# the gloo_ranks fixture (two CPU processes) is in conftest.py


def check(results: list[dict]) -> None:
    for result in results:
        assert all(err <= LOGITS_TOL for err in result["logit_errors"]), result["logit_errors"]
        assert all(result["tokens_equal"].values()), result["tokens_equal"]
        assert result["greedy_is_hf"], "tilefuse.hf.generate's greedy tokens differ from model.generate's"
    assert results[0]["tokens"] == results[1]["tokens"]        # every rank decodes the same tokens
    assert results[0]["unseeded"] == results[1]["unseeded"]    # sampled with a seed drawn on each rank


@pytest.mark.parametrize("variant, order, lm_head", [("v3-dense", "shard-then-patch", True),
                                                     ("v3-moe", "patch-then-shard", False),
                                                     ("v2-lite", "shard-then-patch", True)])
def test_shard_model_deepseek_decodes_like_one_process_gloo(gloo_ranks, variant, order, lm_head):
    results = gloo_ranks.run(job_shard_model, variant, order, lm_head)
    check(results)
    blocks = config_of(variant).num_hidden_layers
    # per block: q_b_proj (q_proj) + kv_b_proj + o_proj + the dense MLP or the shared expert; lm_head
    assert all(r["replaced"] == 4 * blocks + lm_head and r["local_heads"] == 2 for r in results), results


@pytest.mark.parametrize("variant, swiglu", [("v3-dense", True), ("v3-moe", False)])
def test_tp_plan_deepseek_patched_by_tilefuse_parallel_hf_gloo(gloo_ranks, tmp_path, variant, swiglu):
    pytest.importorskip("accelerate", reason="transformers' tp_plan loading needs accelerate")
    path = tmp_path / variant
    model_of(config_of(variant)).save_pretrained(path)
    results = gloo_ranks.run(job_tp_plan, str(path), swiglu)
    check(results)
    blocks = config_of(variant).num_hidden_layers
    assert all(r["loaded_tp"] and r["patched"] == blocks and not r["dtensors_left"] and r["local_heads"] == 2
               for r in results), results
    assert all("kv_b_proj.weight is a DTensor" in r["refused"] and "tilefuse.parallel.hf.patch_mla" in r["refused"]
               for r in results), results


# ----------------------------------------------------------------------------- one process: errors
def test_heads_the_world_size_does_not_cut_are_refused():
    from tilefuse.parallel import shard_model
    from tilefuse.parallel.group import placement
    from tilefuse.parallel.sharding import mla_attention_of

    model = model_of(config_of("v3-dense"))
    with pytest.raises(ValueError, match="world_size: .*config.num_attention_heads=4"):
        shard_model(model, rank=0, world_size=3)
    with pytest.raises(ValueError, match="world_size: .*config.num_attention_heads=4 .*MLA query heads"):
        mla_attention_of(model.model.layers[0].self_attn, placement(rank=0, world_size=8), 4)
    with pytest.raises(ValueError, match="world_size: .*lm_head.out_features=99"):
        shard_model(model_of(transformers.DeepseekV3Config(**{**config_of("v3-dense").to_dict(), "vocab_size": 99})),
                    rank=0, world_size=2, lm_head=True)
    with pytest.raises(ValueError, match="lm_head: expected model.lm_head to be an nn.Linear"):
        shard_model(model.model, rank=0, world_size=2, lm_head=True)
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"          # refused before any change


def test_shards_of_every_rank_make_the_one_device_attention():
    """One process, ranks simulated: each rank's attention shard (its heads, o_proj's partial sum
    without the all-reduce) on the same hidden states; the partial outputs sum to the full
    attention's output (prefill, transformers' own forward over the rank's heads)."""
    from tilefuse.parallel.group import placement
    from tilefuse.parallel.sharding import mla_attention_of

    model = model_of(config_of("v3-dense", heads=8))
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(5)[None].expand(2, -1)
    rope = model.model.rotary_emb(hidden, positions)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)
    with torch.no_grad():
        want = attn(hidden, position_embeddings=rope, attention_mask=mask)[0]
        parts = []
        for rank in range(4):
            part = copy.deepcopy(attn)
            mla_attention_of(part, placement(rank=rank, world_size=4), 8)
            part.o_proj.reduce_results = False
            parts.append(part(hidden, position_embeddings=rope, attention_mask=mask)[0])
    assert parts[0].shape == want.shape
    torch.testing.assert_close(sum(parts), want, rtol=0, atol=LOGITS_TOL * float(want.abs().max()))
    # a shard is not cut again (kv_b_proj stays an nn.Linear, which a second cut would halve)
    rows = part.kv_b_proj.weight.shape[0]
    assert mla_attention_of(part, placement(rank=0, world_size=4), 8) == 0 and part.kv_b_proj.weight.shape[0] == rows


# ----------------------------------------------------------------------------- 2 GPUs, NCCL
# the nccl_ranks fixture (two processes, one GPU each) is in conftest.py


@torch.no_grad()
def job_graph_generate(dtype) -> dict:
    """tilefuse.hf.generate with the decode step captured in a CUDA graph on every rank (its
    o_proj and MLP all-reduces inside the graph), 16 heads (8 per rank), against the one-GPU
    patched model (graph and eager) and the TP model's own eager loop."""
    import tilefuse.hf
    from tilefuse.hf import patch_mla
    from tilefuse.parallel import shard_model

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    full = model_of(config_of("v3-dense", heads=16)).to(device, dtype)
    one = copy.deepcopy(full)
    patch_mla(one)
    shard_model(full)
    patch_mla(full)
    ids, mask = (t.to(device) for t in prompts())
    run = lambda model, graph: tilefuse.hf.generate(model, ids, 24, attention_mask=mask, eos_token_id=[],  # noqa: E731
                                                    pad_token_id=PAD, cuda_graph=graph and cuda)[:, ids.shape[1]:].cpu()
    tokens = {"tp-graph": run(full, True), "tp-graph-again": run(full, True), "tp-eager": run(full, False),
              "one-graph": run(one, True), "one-eager": run(one, False)}
    graphs = sum(g.graph is not None for g in full.__dict__["_tilefuse_generators"].values())
    logits = compare(one, full)["logit_errors"] if dtype == torch.float32 else []
    return {"tokens": {k: v.tolist() for k, v in tokens.items()}, "logit_errors": logits, "graphs": graphs}


@pytest.mark.gpu
def test_generate_with_cuda_graphs_on_every_rank_nccl(nccl_ranks):
    """fp32 (TF32 off): the same greedy tokens as one GPU, graph or eager, and every rank the same
    tokens; logits within 2^-10 of their largest magnitude (the MLA kernels may run their fp32 dots
    in TF32, u = 2^-11; a head cut or summed wrongly is off by O(1))."""
    results = nccl_ranks.run(job_graph_generate, torch.float32)
    for result in results:
        tokens = result["tokens"]
        assert all(t == tokens["one-eager"] for t in tokens.values()), tokens
        assert result["graphs"] == 1 and all(err <= 2 ** -10 for err in result["logit_errors"]), result
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.mark.gpu
def test_generate_with_cuda_graphs_bf16_nccl(nccl_ranks):
    """bf16: the graph replays the TP model's eager step (the same kernels: the dense MLA dispatch
    does not depend on capture, and a 2-rank all-reduce is one rounded a + b in any algorithm),
    so the same tokens; every rank the same tokens."""
    results = nccl_ranks.run(job_graph_generate, torch.bfloat16)
    for result in results:
        tokens = result["tokens"]
        assert tokens["tp-graph"] == tokens["tp-graph-again"] == tokens["tp-eager"], tokens
        assert result["graphs"] == 1, result
    assert results[0]["tokens"] == results[1]["tokens"]


# ----------------------------------------------------------------------------- the benchmark's route
def job_bench_deepseek() -> tuple[list, dict]:
    from tilefuse.bench.tp_deepseek import CPU_PLAN, deepseek_rows, deepseek_summary

    rows = deepseek_rows(CPU_PLAN, torch.device("cpu"), torch.float32, dist.get_world_size(), True)
    return rows, deepseek_summary(rows)


def test_bench_deepseek_pipeline_gloo(gloo_ranks):
    """``tilefuse bench tp``'s DeepSeek part on 2 CPU ranks (tiny model, nothing timed): TP=1 and
    TP=2 decode after a cache filled with a context, the same tokens, logits within the bound."""
    for rows, summary in gloo_ranks.run(job_bench_deepseek):
        assert {(r["tp"], r["impl"], r["mode"]) for r in rows} == {(1, "tilefuse", "eager"), (2, "tilefuse", "eager")}
        assert not any("error" in r for r in rows), rows
        assert all(r["tokens_equal_tp1"] and r["logits_rel_err_vs_tp1"] <= LOGITS_TOL for r in rows), rows
        judged = [g for g in summary["goals"] if g["met"] is not None]
        assert len(judged) == 2 and all(g["met"] for g in judged), summary["goals"]


def test_bench_deepseek_degrees():
    from tilefuse.bench.tp_deepseek import degrees

    assert degrees(1) == [1] and degrees(2) == [1, 2] and degrees(8) == [1, 2, 4, 8] and degrees(6) == [1, 2]
