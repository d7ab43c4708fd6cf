"""The plain-PyTorch references (the executable specs) against independent formulations."""

import math

import pytest
import torch
import torch.nn.functional as F

from tilefuse.ops.mla.reference import mla_decode_reference
from tilefuse.ops.swiglu.reference import swiglu_reference, swiglu_split_reference
from tilefuse.ops.vq.reference import dequantize, vq_matmul_reference
from tilefuse.testing import rel_err

F64 = torch.float64


@pytest.mark.parametrize("shape, hidden, inter", [((1,), 8, 8), ((3, 5), 24, 40)])
def test_swiglu_reference_merged_equals_split_and_formula(shape, hidden, inter):
    x = torch.randn(*shape, hidden, dtype=F64)
    w = torch.randn(2 * inter, hidden, dtype=F64)
    bias = torch.randn(2 * inter, dtype=F64)
    expected = F.silu(F.linear(x, w[:inter], bias[:inter])) * F.linear(x, w[inter:], bias[inter:])
    merged = swiglu_reference(x, w, bias, compute_dtype=F64)
    split = swiglu_split_reference(x, w[:inter], w[inter:], bias[:inter], bias[inter:], compute_dtype=F64)
    assert merged.shape == (*shape, inter)
    assert rel_err(merged, expected) < 1e-14 and torch.equal(merged, split)
    assert swiglu_reference(x.half(), w.half()).dtype == torch.float16


def test_vq_dequantize_matches_a_loop_and_int8_codes():
    n, k = 5, 24
    codes = torch.randint(0, 256, (n, k // 8, 2), dtype=torch.uint8)
    codes[0, 0] = torch.tensor([0, 255], dtype=torch.uint8)
    books = torch.randn(2, 256, 1, 8, dtype=F64)
    scales = torch.rand(n, 1, 1, 1, dtype=F64) + 0.5
    expected = torch.empty(n, k, dtype=F64)
    for row in range(n):
        for g in range(k // 8):
            c0, c1 = int(codes[row, g, 0]), int(codes[row, g, 1])
            expected[row, 8 * g:8 * g + 8] = scales[row, 0, 0, 0] * (books[0, c0, 0] + books[1, c1, 0])
    assert torch.equal(dequantize(codes, books, scales), expected)
    as_int8 = codes.view(torch.int8)          # AQLM's storage: 255 is stored as -1
    assert (as_int8 < 0).any()
    assert torch.equal(dequantize(as_int8, books, scales), expected)
    x = torch.randn(3, k, dtype=F64)
    bias = torch.randn(n, dtype=F64)
    assert rel_err(vq_matmul_reference(x, codes, books, scales, bias, compute_dtype=F64), x @ expected.T + bias) < 1e-14


def _paged(kv_per_request, page=64, num_spare=3):
    """Scatter each request's [L, 576] latents into shuffled pages; NaN everywhere unused."""
    pages_per = [math.ceil(len(kv) / page) for kv in kv_per_request]
    total = sum(pages_per) + num_spare
    cache = torch.full((total, page, 1, kv_per_request[0].shape[-1]), float("nan"), dtype=F64)
    order = torch.randperm(total)
    table = torch.zeros(len(kv_per_request), max(max(pages_per), 1), dtype=torch.int32)
    used = 0
    for i, kv in enumerate(kv_per_request):
        for p in range(pages_per[i]):
            block = int(order[used])
            used += 1
            table[i, p] = block
            chunk = kv[p * page:(p + 1) * page]
            cache[block, : len(chunk), 0] = chunk
    return cache, table


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True), (3, False)])
def test_mla_reference_matches_dense_attention(s_q, causal):
    h_q, d, dv = 4, 576, 512
    lengths = [130, 0, 64, 1]
    kvs = [torch.randn(n, d, dtype=F64) for n in lengths]
    cache, table = _paged(kvs)
    q = torch.randn(len(lengths), s_q, h_q, d, dtype=F64)
    out, lse = mla_decode_reference(q, cache, table, torch.tensor(lengths, dtype=torch.int32), dv,
                                    causal=causal, compute_dtype=F64)
    assert out.shape == (len(lengths), s_q, h_q, dv) and lse.shape == (len(lengths), h_q, s_q)
    for i, kv in enumerate(kvs):
        for t in range(s_q):
            visible = len(kv) - s_q + t + 1 if causal else len(kv)
            if visible <= 0:
                assert torch.all(out[i, t] == 0) and torch.all(lse[i, :, t] == math.inf)
                continue
            scores = q[i, t] @ kv[:visible].T / math.sqrt(d)                 # [h_q, visible]
            assert rel_err(out[i, t], torch.softmax(scores, -1) @ kv[:visible, :dv]) < 1e-12
            assert rel_err(lse[i, :, t], torch.logsumexp(scores, -1)) < 1e-12
    assert torch.isfinite(out).all()           # the NaN-filled unused slots never leaked
