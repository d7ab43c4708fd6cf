"""Cases for the VQ family, shared by the tests and ``tilefuse bench vq``.

``SHAPES`` ((N, K) layer shapes), ``make_case()`` (random inputs), ``reference_fp64()`` (the spec in
fp64), plus the error scale and tolerances the comparisons use. Random codes / codebooks / scales
in AQLM's 2x8 layout; magnitudes are chosen so that the dequantized weight has entries of order
``1/sqrt(K)`` (like a trained layer) and outputs of order 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilefuse.testing.compare import assert_within

# (N, K) of the benchmark's layers: Llama-2-7B (4096/11008), 70B (8192/28672) projections.
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192), (28672, 8192), (8192, 28672)]
TOKENS = (1, 2, 4, 8, 16, 64, 512)


@dataclass
class VQCase:
    x: torch.Tensor                   # [M, K]
    codes: torch.Tensor               # [N, K/8, 2]
    codebooks: torch.Tensor           # [2, 256, 1, 8]
    scales: torch.Tensor              # [N, 1, 1, 1]
    bias: torch.Tensor | None         # [N] or None

    def args(self):
        return self.x, self.codes, self.codebooks, self.scales, self.bias


def make_weight(n: int, k: int, dtype: torch.dtype, device, *, codes_dtype: torch.dtype = torch.uint8,
                scale_dtype: torch.dtype | None = None):
    """(codes [N, K/8, 2], codebooks [2, 256, 1, 8] dtype, scales [N, 1, 1, 1]) with random content."""
    codes = torch.randint(0, 256, (n, k // 8, 2), dtype=torch.int32, device=device)
    if codes_dtype == torch.int8:
        codes = torch.where(codes > 127, codes - 256, codes)   # AQLM: two's complement int8
    codes = codes.to(codes_dtype)
    codebooks = (torch.randn(2, 256, 1, 8, device=device) / math.sqrt(2.0)).to(dtype)
    scales = (torch.rand(n, 1, 1, 1, device=device) + 0.5) / math.sqrt(k)
    return codes, codebooks, scales.to(scale_dtype or dtype)


def make_case(m: int, n: int, k: int, dtype: torch.dtype, device, *, bias: bool = False,
              codes_dtype: torch.dtype = torch.uint8) -> VQCase:
    """x [m, K], a random 2x8 weight [N, K] (codes, codebooks, scales) and a bias [N] or None."""
    codes, codebooks, scales = make_weight(n, k, dtype, device, codes_dtype=codes_dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return VQCase(x, codes, codebooks, scales, b)


def make_overflow_case(m: int, n: int, k: int, dtype: torch.dtype, device, *, bias: bool = False,
                       codebooks_dtype: torch.dtype | None = None, shift: int = 14) -> VQCase:
    """:func:`make_case` with codebooks ``2^shift`` times larger and scales ``2^shift`` times
    smaller (fp32; the same weights), and the entry pairs (7, 9) and (11, 13) set to +-40000 x
    ``2^(shift - 14)`` and used by about a fifth of the groups: ``C0[a] + C1[b]`` overflows fp16
    (|sum| > 65504) while every scaled weight stays small. ``codebooks_dtype``: fp32 codebooks
    with ``shift`` > 14 hold entries beyond fp16's range."""
    case = make_case(m, n, k, dtype, device, bias=bias)
    books_dtype = codebooks_dtype or dtype
    big = 40000.0 * 2.0 ** (shift - 14)
    books = case.codebooks.double() * 2.0 ** shift
    books[0, 7], books[1, 9], books[0, 11], books[1, 13] = big, big, -big, -big
    case.codebooks = books.to(books_dtype)
    gen = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    pick = torch.randint(0, 10, (n, k // 8), generator=gen).to(device)
    codes = case.codes.long()
    codes[..., 0] = torch.where(pick == 0, 7, torch.where(pick == 1, 11, codes[..., 0]))
    codes[..., 1] = torch.where(pick == 0, 9, torch.where(pick == 1, 13, codes[..., 1]))
    case.codes = codes.to(case.codes.dtype)
    case.scales = (case.scales.double() * 2.0 ** -shift).float()      # fp32: fp16 would be subnormal here
    return case


def reference_fp64(case: VQCase) -> torch.Tensor:
    """The spec evaluated in fp64 on the case's (already rounded) inputs."""
    from tilefuse.ops.vq.reference import vq_matmul_reference

    b = case.bias
    return vq_matmul_reference(case.x.double(), case.codes, case.codebooks.double(), case.scales.double(),
                               None if b is None else b.double(), compute_dtype=torch.float64)


def error_scale(case: VQCase) -> torch.Tensor:
    """``|x| @ |W|^T`` in fp64: what rounding errors of the products are measured against.

    A relative error ``d`` on every weight moves an output by at most ``d * (|x| @ |W|^T)``, which
    (unlike ``|y|``) does not vanish when the sum cancels.
    """
    from tilefuse.ops.vq.reference import dequantize

    w = dequantize(case.codes, case.codebooks.double(), case.scales.double(), dtype=torch.float64)
    return case.x.double().abs() @ w.abs().T


def tolerance(dtype: torch.dtype, variant: str) -> dict:
    """``|out - ref| <= rtol * |ref| + scale * error_scale`` against the fp64 reference.

    rtol: one ulp of the output dtype (the final rounding is at most half of it).
    scale: the decode kernel's table and sums are fp32 (codebooks and x are exact in fp32 products):
    2^-14 bounds its accumulation error far below the output rounding. The MMA kernels (``mma``,
    ``prefill``) also
    rounds each dequantized weight ``C0[a] + C1[b]`` to x's dtype before the tensor-core GEMM: at
    most one unit roundoff u (2^-11 fp16, 2^-8 bf16) per weight, hence ``u + 2^-14``. The dequant
    path rounds ``scale * (C0[a] + C1[b])`` once per weight too, then leaves the GEMM to cuBLAS,
    whose fp16/bf16 reductions PyTorch lets run in reduced precision: ``2u + 2^-14``.
    """
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    scale = 2.0 ** -14 + {"prefill": ulp / 2, "mma": ulp / 2, "mma_gluon": ulp / 2, "small": ulp / 2,
                             "dequant": ulp}.get(variant, 0.0)
    return dict(rtol=ulp, scale=scale)


def check(out: torch.Tensor, case: VQCase, variant: str) -> None:
    """Assert ``out`` (no NaN: poisoned outputs left unwritten show) is within ``variant``'s
    :func:`tolerance` of the fp64 spec on ``case``, naming the first output off and its bound."""
    ref = reference_fp64(case)
    tol = tolerance(out.dtype, variant)
    assert_within(out, ref, tol["rtol"] * ref.abs() + tol["scale"] * error_scale(case), f"{variant}: ")


# ----------------------------------------------------------------------------- MoE experts
# (E, H, I, top-k): Qwen3-30B-A3B's routed experts; DeepSeek-V2-Lite / Qwen1.5-MoE-A2.7B-like (held out)
MOE_SHAPES = [(128, 2048, 768, 8), (64, 2048, 1408, 6)]


@dataclass
class MoECase:
    x: torch.Tensor                   # [T, H]
    top_k_index: torch.Tensor         # [T, k] expert ids
    top_k_weights: torch.Tensor       # [T, k]
    gate_up_codes: torch.Tensor       # [E, 2I, H/8, 2]
    gate_up_codebooks: torch.Tensor   # [E, 2, 256, 1, 8]
    gate_up_scales: torch.Tensor      # [E, 2I, 1, 1, 1]
    down_codes: torch.Tensor          # [E, H, I/8, 2]
    down_codebooks: torch.Tensor      # [E, 2, 256, 1, 8]
    down_scales: torch.Tensor         # [E, H, 1, 1, 1]

    def args(self, x: torch.Tensor | None = None) -> tuple:
        return (self.x if x is None else x, self.top_k_index, self.top_k_weights, self.gate_up_codes,
                self.gate_up_codebooks, self.gate_up_scales, self.down_codes, self.down_codebooks, self.down_scales)


def make_moe_case(t: int, k: int, e: int, h: int, i: int, dtype: torch.dtype, device, *,
                  codes_dtype: torch.dtype = torch.uint8, index_dtype: torch.dtype = torch.int64,
                  distinct: bool = True) -> MoECase:
    """x [T, H], routing [T, k] (distinct experts per token where ``distinct`` and k <= E, as a
    router's top-k gives; else any, repeats included) with softmax-like weights, and E experts'
    random 2x8 gate/up ``[2I, H]`` and down ``[H, I]`` weights (:func:`make_weight`'s magnitudes)."""
    weights = [make_weight(2 * i, h, dtype, device, codes_dtype=codes_dtype) for _ in range(e)]
    downs = [make_weight(h, i, dtype, device, codes_dtype=codes_dtype) for _ in range(e)]
    if distinct and k <= e:
        index = torch.rand(t, e, device=device).argsort(dim=1)[:, :k]
    else:
        index = torch.randint(0, e, (t, k), device=device)
    routing = torch.rand(t, k, device=device).softmax(dim=1)
    stack = [torch.stack([w[j] for w in ws]) for ws in (weights, downs) for j in range(3)]
    return MoECase(torch.randn(t, h, device=device).to(dtype), index.to(index_dtype).contiguous(), routing.to(dtype),
                   *stack)


def moe_reference_fp64(case: MoECase) -> torch.Tensor:
    """The MoE spec (``vq_moe_reference``) in fp64 on the case's rounded inputs (h not rounded)."""
    from tilefuse.ops.vq.reference import vq_moe_reference

    return vq_moe_reference(case.x.double(), case.top_k_index, case.top_k_weights.double(), case.gate_up_codes,
                            case.gate_up_codebooks.double(), case.gate_up_scales.double(), case.down_codes,
                            case.down_codebooks.double(), case.down_scales.double(), compute_dtype=torch.float64)


SILU_SLOPE = 1.1        # max |silu'(t)| = 1.0998 (at t = 2.4)


def moe_bound(case: MoECase, variant: str = "small") -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp64 reference y [T, H], the bound on ``|out - y|``), on the case's device.

    Per token-expert pair, the gate/up as ``vq_swiglu``'s fused kernel (each projection within
    ``s = tolerance(dtype, "small")["scale"]`` times ``|x| @ |W|^T``, SiLU's slope below 1.1, one
    rounding of h to x's dtype: ``e_h``); the down projection of the rounded h moves by
    ``e_h @ |Wd|^T`` plus its own ``s * (|h| + e_h) @ |Wd|^T``, times ``|w|``; the fp32 sum over
    the k slots adds ``2^-20 * sum |y_p|`` (k <= 8 fp32 additions) and the output's rounding one
    ulp of ``|y|``. ``variant="dequant"`` (``op.launch_moe_dequant``): ``s`` is the dequantize
    path's (weights rounded to x's dtype, reductions in reduced precision), and the grouped GEMMs'
    outputs g, u and ``y_p`` are rounded to x's dtype too: half an ulp of each more."""
    from tilefuse.ops.vq.reference import dequantize

    if variant not in ("small", "dequant"):
        raise ValueError(f"variant: expected 'small' or 'dequant', got {variant!r}")
    dequant = variant == "dequant"
    dtype = case.x.dtype if case.x.dtype in (torch.float16, torch.bfloat16) else torch.float16
    tol = tolerance(dtype, variant)
    ulp, s = tol["rtol"], tol["scale"]
    x = case.x.double()
    e_count, i = case.gate_up_codes.shape[0], case.gate_up_codes.shape[1] // 2
    ref = torch.zeros_like(x)
    bound = torch.zeros_like(x)
    for e in torch.unique(case.top_k_index).tolist():
        if not 0 <= e < e_count:
            continue
        tok, slot = (case.top_k_index == e).nonzero(as_tuple=True)
        w_gu = dequantize(case.gate_up_codes[e], case.gate_up_codebooks[e].double(), case.gate_up_scales[e].double(),
                          dtype=torch.float64)
        w_d = dequantize(case.down_codes[e], case.down_codebooks[e].double(), case.down_scales[e].double(),
                         dtype=torch.float64)
        gu, gu_scale = x[tok] @ w_gu.T, x[tok].abs() @ w_gu.abs().T
        g, u = gu[:, :i], gu[:, i:]
        e_g, e_u = s * gu_scale[:, :i], s * gu_scale[:, i:]
        if dequant:
            e_g, e_u = e_g + ulp / 2 * g.abs(), e_u + ulp / 2 * u.abs()
        silu = g * torch.sigmoid(g)
        hh = silu * u
        e_h = ulp * hh.abs() + SILU_SLOPE * u.abs() * e_g + silu.abs() * e_u + SILU_SLOPE * e_g * e_u
        weight = case.top_k_weights[tok, slot].double()[:, None]
        y = weight * (hh @ w_d.T)
        ref.index_add_(0, tok, y)
        bound.index_add_(0, tok, weight.abs() * (e_h @ w_d.abs().T + s * (hh.abs() + e_h) @ w_d.abs().T)
                         + (2.0 ** -20 + (ulp / 2 if dequant else 0.0)) * y.abs())
    return ref, bound + ulp * ref.abs()


def check_moe(out: torch.Tensor, case: MoECase, variant: str = "small") -> None:
    """Assert ``out`` (no NaN: poisoned outputs left unwritten show) is within :func:`moe_bound`
    (of ``variant``) of the fp64 spec on ``case``, naming the first output off and its bound."""
    ref, bound = moe_bound(case, variant)
    want = moe_reference_fp64(case)
    assert torch.allclose(want, ref, rtol=1e-12, atol=1e-12), "the spec and the bound's fp64 y differ"
    assert out.shape == ref.shape and out.dtype == case.x.dtype, (out.shape, out.dtype)
    assert_within(out, ref, bound)
