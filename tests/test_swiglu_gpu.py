"""Fused SwiGLU on the H200: bench shapes, bf16 and fp16, both schedules forced and dispatched.

Tolerances, against the fp64 reference:
* elementwise: 1 ulp relative (``rtol = 2^-7`` bf16, ``2^-10`` fp16) plus ``atol = 1e-3`` for outputs
  near zero; one rounding after fp32 accumulation is within 0.5 ulp + ~1e-5 absolute for H <= 8192.
  A wrong row/column/layout/SiLU is off by O(1).
* fraction of outputs beyond 1 ulp (the paper's measure): an output whose gate or up projection
  lies within ~500x the accumulation error of zero can round to the neighbouring value. Exact fp32
  (CPU) gives ~1e-5..3e-5 (bf16); the H200's tensor cores accumulate fp32 with truncation, and the
  first H200 run measured 1e-4 (H = 896) growing with H to 1.1e-3 (H = 8192) for bf16, ~6e-3 for
  fp16 (finer ulp). Bounds: 2e-3 (bf16), 1.5e-2 (fp16), plus 3 elements for small samples; the
  unfused recipe sits at ~10 %, a wrong kernel near 100 %. With per-K-step promotion (opt-in
  ``promote=True``) the bound is the issue's 1e-4 (met on the H200). The benchmark reports the fractions.
The reference is computed in fp64 on a sample of rows (first, last and random ones); every output
element is checked to be written (the buffer is poisoned with NaN).
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.swiglu import configs
from tilefuse.ops.swiglu.op import pack_gate_up, run_kernel
from tilefuse.testing import assert_close, frac_beyond_ulp, poisoned
from tilefuse.testing.swiglu import QWEN25_SHAPES, make_inputs, reference_f64

pytestmark = pytest.mark.gpu
RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
FRAC = {torch.bfloat16: 2e-3, torch.float16: 1.5e-2}


def _sample_rows(m):
    if m <= 384:
        return torch.arange(m)
    return torch.cat((torch.arange(128), torch.randint(128, m - 128, (128,)), torch.arange(m - 128, m)))


def _check(out, x, w, bias, frac_bound=None):
    assert torch.isfinite(out).all(), "unwritten (NaN) or overflowed outputs"
    rows = _sample_rows(x.shape[0]).to(x.device)
    ref = reference_f64(x[rows], w, bias)
    n = ref.numel()
    frac = frac_beyond_ulp(out[rows], ref)
    bound = FRAC[out.dtype] if frac_bound is None else frac_bound
    assert frac <= bound + 3 / n, f"{frac:.2e} of {n} outputs beyond 1 ulp"
    assert_close(out[rows], ref, atol=1e-3, rtol=RTOL[out.dtype])


MODELS_BF16 = list(QWEN25_SHAPES)
MODELS_FP16 = ["0.5B", "14B", "72B"]
CASES = ([(mdl, torch.bfloat16) for mdl in MODELS_BF16] + [(mdl, torch.float16) for mdl in MODELS_FP16])


@pytest.mark.parametrize("variant", ["small_m", "large_m", None], ids=["small_m", "large_m", "dispatch"])
@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize("model,dtype", CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in CASES])
def test_bench_shapes(model, dtype, m, variant):
    h, i = QWEN25_SHAPES[model]
    x, w, _ = make_inputs(m, h, i, dtype, "cuda")
    out = poisoned((m, i), dtype, "cuda")
    run_kernel(x, w, None, "merged", variant, out=out)
    _check(out, x, w, None)


@pytest.mark.parametrize("variant", ["small_m", "large_m"])
@pytest.mark.parametrize("m", [1, 37, 300, 2051])
def test_packed_and_bias_odd_m(variant, m):
    h, i = QWEN25_SHAPES["1.5B"]
    x, w, bias = make_inputs(m, h, i, torch.bfloat16, "cuda", bias=True)
    with tilefuse.force(variant=variant):
        merged = tilefuse.swiglu(x, w, bias)
        packed = tilefuse.swiglu(x, pack_gate_up(w[:i], w[i:]), bias, layout="packed")
    _check(merged, x, w, bias)
    _check(packed, x, w, bias)


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_fixup_repeated(split_k):
    """Split-K tickets are re-armed: many back-to-back launches stay exact and identical."""
    h, i = QWEN25_SHAPES["7B"]
    x, w, _ = make_inputs(16, h, i, torch.bfloat16, "cuda")
    cfg = configs.SmallMConfig(16, 32, 128, split_k=split_k)
    first = run_kernel(x, w, None, config=cfg)
    _check(first, x, w, None)
    for _ in range(20):
        again = run_kernel(x, w, None, config=cfg)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [configs.LargeMConfig(), configs.LargeMConfig(128, 64, 64, 8, 4, 4, False),
                                 configs.LargeMConfig(64, 128, 64, 8, 4, 4, False)], ids=["ws", "128x64", "64x128"])
def test_large_m_configs_odd_shape(cfg):
    x, w, _ = make_inputs(1000, 1032, 1000, torch.float16, "cuda")  # nothing divides the tiles
    _check(run_kernel(x, w, None, config=cfg), x, w, None)


@pytest.mark.parametrize("cfg", [configs.LargeMConfig(128, 128, 64, 8, 4, 8, False, stream_k=1),
                                 configs.LargeMConfig(128, 64, 64, 8, 4, 4, False, stream_k=2)], ids=["sk1", "sk2"])
@pytest.mark.parametrize("model,m", [("0.5B", 128), ("1.5B", 128), ("7B", 128), ("0.5B", 1024), ("3B", 1024),
                                     ("72B", 37)])
def test_stream_k_tail(model, m, cfg):
    """Stream-K tail on bench shapes: exact, every output written, bit-identical over repeated
    launches and CUDA-graph replays (the tickets are re-armed, the fix-up order is fixed)."""
    h, i = QWEN25_SHAPES[model]
    x, w, bias = make_inputs(m, h, i, torch.bfloat16, "cuda", bias=model == "1.5B")
    out = poisoned((m, i), torch.bfloat16, "cuda")
    first = run_kernel(x, w, bias, config=cfg, out=out).clone()
    _check(first, x, w, bias)
    for _ in range(5):
        torch.testing.assert_close(run_kernel(x, w, bias, config=cfg), first, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run_kernel(x, w, bias, config=cfg)
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(replayed, first, rtol=0, atol=0)


def test_unaligned_and_strided_inputs():
    h, i = 896, 4864
    x, w, _ = make_inputs(130, h + 8, i, torch.bfloat16, "cuda")
    w = w[:, :h].contiguous()
    strided = x[:, 8:]  # row stride H + 8 (16-byte multiple), offset 16 bytes: TMA-able as is
    flat = torch.randn(130 * h + 4, device="cuda").to(torch.bfloat16)
    unaligned = flat[4:].view(130, h)  # base 8 bytes off a 16-byte boundary: not TMA-able
    assert unaligned.data_ptr() % 16 == 8
    for variant in ("small_m", "large_m"):
        with tilefuse.force(variant=variant):
            _check(tilefuse.swiglu(strided, w), strided, w, None)
            _check(tilefuse.swiglu(unaligned, w), unaligned, w, None)


@pytest.mark.parametrize("model", ["7B", "72B"])
def test_promoted_accumulation_meets_accuracy_target(model):
    """Small-M kernel with promote=True: <= 0.01 % of bf16 outputs beyond 1 ulp (the issue's target).

    The first H200 run failed this (4.4e-4 at 7B, 1.0e-3 at 72B) because Triton had folded the
    promotion away; the run-time-zero version passed on the H200 (2026-11-29 tail runs, as xfail).
    """
    h, i = QWEN25_SHAPES[model]
    x, w, _ = make_inputs(16, h, i, torch.bfloat16, "cuda")
    out = run_kernel(x, w, None, config=configs.SmallMConfig(16, 64, 256, 1, 3, promote=True))
    _check(out, x, w, None, frac_bound=1e-4)
