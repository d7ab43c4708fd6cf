"""The shape corpus (``tilefuse.testing.corpus``): well-formed, and every SwiGLU path right on
scaled-down corpus shapes in the interpreter."""

import pytest
import torch

import tilefuse
from tilefuse.ops.swiglu import configs
from tilefuse.ops.swiglu.op import run_kernel
from tilefuse.testing import assert_close, corpus, poisoned
from tilefuse.testing.swiglu import make_case, reference_fp64


def test_models_and_shapes_are_well_formed():
    assert len(corpus.MODELS) >= 20
    assert {m.family for m in corpus.MODELS.values()} == {"dense", "moe"}
    assert set(corpus.HELD_OUT) <= set(corpus.MODELS)
    for model in corpus.MODELS.values():
        assert model.hidden % 64 == 0 and model.heads % model.kv_heads == 0, model.name
        for s in corpus.swiglu_shapes(model):
            h, i = s.dims
            assert h == model.hidden and i % 8 == 0 and s.tp in corpus.TP_DEGREES   # the op's multiples
            assert i * s.tp in (model.intermediate, model.moe_intermediate, model.shared_intermediate)
        for s in corpus.linear_shapes(model):
            n, k = s.dims
            assert k % 8 == 0 and n % 8 == 0, (model.name, s)                   # VQ groups of 8 along K
    deepseek = {s.role: s.dims for s in corpus.swiglu_shapes(corpus.MODELS["deepseek-v3"], (1,))}
    assert deepseek == {"mlp": (7168, 18432), "expert": (7168, 2048), "shared": (7168, 2048)}
    roles = {s.role for s in corpus.linear_shapes(corpus.MODELS["deepseek-v3"])}
    assert {"q_a", "q_b", "kv_a", "kv_b", "o", "expert.gate_up", "expert.down"} <= roles


def test_tokens_cover_every_bucket_and_the_quick_sample_is_fixed():
    buckets = {corpus.bucket_of(t) for t in corpus.TOKENS}
    assert buckets == {"1", "2-16", "17-128", "129-1024", "1025-16384"}
    assert any(t % 2 for t in corpus.TOKENS if t > 1)                    # odd counts included
    for op in ("swiglu", "linear"):
        quick = corpus.quick_cases(op)
        assert quick == corpus.quick_cases(op)
        assert {corpus.bucket_of(m) for _, m in quick} == buckets
        assert len({s.dims for s, _ in corpus.cases(op)}) == len(corpus.shapes(op))
    with pytest.raises(ValueError, match="tokens"):
        corpus.bucket_of(0)


def _scaled(dims, to=256):
    """A corpus shape shrunk for the interpreter, keeping its aspect and multiples of 8."""
    h, i = dims
    f = max(h, i) / to
    return max(8, round(h / f / 8) * 8), max(8, round(i / f / 8) * 8)


@pytest.mark.parametrize("variant", ["small_m", "large_m", "unfused", None])
def test_every_path_on_scaled_corpus_shapes(interpret, variant):
    """Three corpus shapes (a dense MLP, a routed expert, a sharded one), scaled down, at one M per
    bucket below 1024: each path forced (None: the dispatch's pick) against the fp64 spec, with
    the path's tolerance (the unfused path rounds gate and up first: 4 ulp, see test_swiglu)."""
    picks = [s for s in corpus.shapes("swiglu") if s.role in ("mlp", "expert")][:2]
    picks += [s for s in corpus.shapes("swiglu") if s.tp == 8][:1]
    for shape in picks:
        h, i = _scaled(shape.dims)
        for m in (1, 7, 33, 130):
            x, w, _ = make_case(m, h, i, torch.float16, interpret)
            out = poisoned((m, i), torch.float16, interpret)
            with tilefuse.force(variant=variant):
                chosen = configs.choose(m, h, i, variant)[0] if variant else tilefuse.explain(
                    tilefuse.swiglu, x, w).variant
                run_kernel(x, w, None, "merged", variant, out=out)
            rtol = (4 if chosen == "unfused" else 1) * 2 ** -10
            assert_close(out, reference_fp64(x, w), atol=1e-4, rtol=rtol, name=f"{shape.model} {shape.role} {m}")
