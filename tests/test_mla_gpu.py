"""MLA decode on the H200 at real shapes, bf16 and fp16, against the fp64 reference.

Tolerances: out is compared by cos_diff (FlashMLA's bar, 1e-5) and elementwise with
atol = rtol = 1e-2 (bf16 output rounding is 2^-8 = 4e-3 relative; out values are O(0.1)); lse
with atol 1e-3 (fp32 online softmax over <= 64K keys with bf16-rounded P in the second dot only).
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.mla.reference import mla_decode_reference
from tilefuse.testing.compare import assert_close, cos_diff
from tilefuse.testing.mla import mla_inputs

pytestmark = pytest.mark.gpu


def _run(inp, s_q, h_q, causal, variant=None):
    with tilefuse.force(backend="triton", variant=variant):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=causal)


def _check(out, lse, inp, causal):
    ro, rl = mla_decode_reference(*inp.args(), 512, causal=causal, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert cos_diff(out, ro) < 1e-5
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isinf(lse), ~finite)          # empty rows: lse = +inf exactly
    assert cos_diff(lse[finite], rl[finite]) < 1e-5
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    assert_close(lse, rl, atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (16, 2), (64, 1), (128, 2), (1, 4)])
@pytest.mark.parametrize("variant", ["transposed", "standard"])   # the default is one of them
def test_mla_gpu_equal(dtype, h_q, s_q, variant):
    if variant == "transposed" and h_q * s_q >= 64:
        pytest.skip("transposed applies below 64 query rows")
    inp = mla_inputs([4096 + 17] * 8, s_q, h_q, dtype, "cuda")
    out, lse = _run(inp, s_q, h_q, True, variant)
    _check(out, lse, inp, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, False), (16, 2, True), (128, 1, True), (128, 2, False)])
def test_mla_gpu_mixed(dtype, h_q, s_q, causal):
    lens = [0, 1, 63, 64, 65, 1000, 20000, 4097, 0, 333, 70000, 128]
    inp = mla_inputs(lens, s_q, h_q, dtype, "cuda")
    out, lse = _run(inp, s_q, h_q, causal)
    _check(out, lse, inp, causal)


@pytest.mark.parametrize("h_q", [16, 128])
def test_mla_gpu_graph_replay(h_q):
    """Capture metadata + attention once, replay with new lengths: the result follows the lengths."""
    s_q, dtype = 1, torch.bfloat16
    inp = mla_inputs([3000] * 6, s_q, h_q, dtype, "cuda")
    lens = inp.cache_seqlens.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(inp, s_q, h_q, True)                       # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _run(inp, s_q, h_q, True)
    for new in ([3000] * 6, [1, 0, 2999, 64, 1500, 2000], [100] * 6):
        inp.cache_seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, inp, True)
    inp.cache_seqlens.copy_(lens)


def test_mla_gpu_nan_tail_does_not_leak():
    """Every slot past the lengths is NaN (mla_inputs poisons them): outputs must stay finite."""
    inp = mla_inputs([65, 130, 1], 1, 16, torch.bfloat16, "cuda")
    out, lse = _run(inp, 1, 16, False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("key,variant", [("transposed", "transposed"), ("standard_small", "standard"),
                                         ("standard", "standard")])
def test_mla_gpu_unfused_combine(monkeypatch, key, variant):
    """The second-launch combine (a sweep candidate) with each kernel, on mixed lengths."""
    from tilefuse.ops.mla import configs

    configs.launch_config.cache_clear()
    monkeypatch.setitem(configs.CONFIGS, key, dict(configs.CONFIGS[key], fused_combine=False))
    h_q = 128 if key == "standard" else 16
    inp = mla_inputs([0, 1, 65, 20000, 4097, 333, 70000, 128], 1, h_q, torch.bfloat16, "cuda")
    try:
        out, lse = _run(inp, 1, h_q, True, variant)
    finally:
        monkeypatch.undo()
        configs.launch_config.cache_clear()
    _check(out, lse, inp, True)
