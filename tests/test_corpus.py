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


# ----------------------------------------------------------------------------- GPU
# Every quick corpus case (one token count per bucket on a fixed subsample of the shapes) through
# the default dispatch at its real size, against the fp64 spec on a sample of rows (the first and
# last 64 and 64 random ones). Tolerances: SwiGLU bf16, 1 ulp (2^-7) relative + 1e-3 absolute,
# 4 ulps where the dispatch picks the unfused path (gate and up are rounded to bf16 before the
# SiLU*mul pass, see test_swiglu); VQ fp16, the chosen kernel's bound from ``testing.vq.tolerance``.
def _rows(m, device):
    if m <= 192:
        return torch.arange(m, device=device)
    return torch.cat((torch.arange(64), torch.randint(64, m - 64, (64,)), torch.arange(m - 64, m))).to(device)


def _case_id(case):
    shape, m = case
    return f"{shape.model}-{shape.role}-tp{shape.tp}-{shape.dims[0]}x{shape.dims[1]}-m{m}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", corpus.quick_cases("swiglu"), ids=_case_id)
def test_gpu_swiglu_corpus_default_dispatch(case):
    shape, m = case
    h, i = shape.dims
    x, w, _ = make_case(m, h, i, torch.bfloat16, "cuda")
    out = tilefuse.swiglu(x, w)
    chosen = tilefuse.explain(tilefuse.swiglu, x, w).variant
    assert torch.isfinite(out).all(), f"{chosen}: unwritten (NaN) or non-finite outputs"
    rows = _rows(m, x.device)
    rtol = (4 if chosen == "unfused" else 1) * 2 ** -7
    assert_close(out[rows], reference_fp64(x[rows], w), atol=1e-3, rtol=rtol, name=f"{chosen} {_case_id(case)}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", corpus.quick_cases("linear"), ids=_case_id)
def test_gpu_vq_corpus_default_dispatch(case):
    from tilefuse.testing import vq as vq_testing

    shape, m = case
    n, k = shape.dims
    full = vq_testing.make_case(m, n, k, torch.float16, "cuda")
    out = tilefuse.vq_matmul(full.x, full.codes, full.codebooks, full.scales)
    chosen = tilefuse.explain(tilefuse.vq_matmul, full.x, full.codes, full.codebooks, full.scales).variant
    assert torch.isfinite(out).all(), f"{chosen}: unwritten (NaN) or non-finite outputs"
    rows = _rows(m, full.x.device)
    sample = vq_testing.VQCase(full.x[rows], full.codes, full.codebooks, full.scales, None)
    ref = vq_testing.reference_fp64(sample)
    tol = vq_testing.tolerance(torch.float16, chosen)
    err = (out[rows].double() - ref).abs()
    bad = ~(err <= tol["rtol"] * ref.abs() + tol["scale"] * vq_testing.error_scale(sample))
    assert not bad.any(), f"{chosen} {_case_id(case)}: {int(bad.sum())} of {bad.numel()} sampled outputs off"
