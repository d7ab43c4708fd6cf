"""tilefuse.vq_matmul: decode (table + lookup, one launch) and prefill (dequant + GEMM) kernels.

CPU: the kernels run in Triton's interpreter, fp16 only (the interpreter computes bf16 tl.dot from
raw bits), small shapes. GPU (@gpu): bench shapes, fp16 + bf16, every variant forced explicitly.
Every comparison is against the spec evaluated in fp64 (``tilefuse.testing.vq.reference_fp64``);
tolerances are explained in ``tilefuse.testing.vq.tolerance``.
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.vq import op as vq_op
from tilefuse.testing import assert_close, poisoned
from tilefuse.testing.vq import SHAPES, make_case, make_overflow_case, reference_fp64
from tilefuse.testing.vq import check as _check

LAUNCH = {"decode": lambda c, out: vq_op.launch_decode(*_args(c), out, impl="auto"),
          "decode_resident": lambda c, out: vq_op.launch_decode(*_args(c), out, impl="resident"),
          "decode_gather": lambda c, out: vq_op.launch_decode(*_args(c), out, impl="gather"),
          "decode_tl": lambda c, out: vq_op.launch_decode(*_args(c), out, impl="tl"),
          "mma": lambda c, out: vq_op.launch_mma(*_args(c), out, impl="auto"),
          "mma_gluon": lambda c, out: vq_op.launch_mma(*_args(c), out, impl="gluon"),
          "prefill": lambda c, out: vq_op.launch_prefill(*_args(c), out, impl="auto"),
          "prefill_tl": lambda c, out: vq_op.launch_prefill(*_args(c), out, impl="tl"),
          "prefill_wgmma": lambda c, out: vq_op.launch_prefill(*_args(c), out, impl="wgmma"),
          "dequant": lambda c, out: vq_op.launch_dequant(*_args(c), out)}


def _args(case):
    n = case.codes.shape[0]
    return case.x, case.codes, case.codebooks, case.scales.reshape(n), case.bias


def _run_poisoned(case, variant):
    m, n = case.x.shape[0], case.codes.shape[0]
    out = poisoned((m, n), case.x.dtype, case.x.device)
    LAUNCH[variant](case, out)
    return out


# (M tokens, N rows, K): N = 1 and 37, K/8 groups not a multiple of the 32-column K step (264 -> 33)
CPU_SHAPES = [(1, 1, 64), (1, 37, 264), (2, 37, 136), (3, 16, 64), (8, 33, 72)]


@pytest.mark.parametrize("variant", ["decode", "mma", "dequant"])
@pytest.mark.parametrize("m,n,k", CPU_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_interpreted(interpret, variant, m, n, k, bias):
    case = make_case(m, n, k, torch.float16, interpret, bias=bias)
    _check(_run_poisoned(case, variant), case, variant)


def test_code_words_byte_order():
    """The resident kernel's int32 words: bytes c0(2w), c1(2w), c0(2w+1), c1(2w+1), low first."""
    codes = torch.randint(0, 256, (5, 6, 2), dtype=torch.uint8)
    words = vq_op.code_words(codes).to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (5, 3)
    for j, (g, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert torch.equal((words >> (8 * j)) & 0xFF, codes[:, g::2, c].to(torch.int64))


@pytest.mark.parametrize("split_k", [1, 3])
def test_decode_split_k_leaves_scratch_clean(interpret, split_k):
    """Split-K partials meet in zeroed scratch that the last program must leave zeroed."""
    from tilefuse import _scratch

    case = make_case(2, 40, 512, torch.float16, interpret)
    outs = []
    for _ in range(2):  # a second call must not see the first call's sums
        out = poisoned((2, 40), torch.float16, interpret)
        vq_op.launch_decode(*_args(case), out, split_k=split_k)
        outs.append(out)
    _check(outs[0], case, "decode")
    assert torch.equal(outs[0], outs[1])
    assert all(not buf.any() for (_, _, zero), buf in _scratch._arenas.items() if zero)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k", [(2, 37, 264), (16, 33, 520)])
def test_mma_split_k_interpreted(interpret, split_k, m, n, k):
    """The tl MMA kernel with its K split forced, odd N, K/8 not a multiple of the step."""
    case = make_case(m, n, k, torch.float16, interpret, bias=True, codes_dtype=torch.int8)
    out = poisoned((m, n), torch.float16, interpret)
    vq_op.launch_mma(*_args(case), out, split_k=split_k)
    _check(out, case, "mma")


@pytest.mark.parametrize("variant", ["decode", "mma", "dequant"])
@pytest.mark.parametrize("pattern", ["zeros", "255", "alternating"])
def test_extreme_codes(interpret, variant, pattern):
    case = make_case(2, 24, 128, torch.float16, interpret)
    codes = case.codes
    if pattern == "zeros":
        codes.zero_()
    elif pattern == "255":
        codes.fill_(255)
    else:
        codes.copy_((torch.arange(codes.numel()) % 2 * 255).reshape(codes.shape).to(codes.dtype))
    _check(_run_poisoned(case, variant), case, variant)


@pytest.mark.parametrize("m", [1, 12, 20])      # decode, MMA decode, dequant + GEMM
def test_int8_codes_match_uint8(interpret, m):
    """AQLM stores int8: -1 is code 255. Same bits, same result, whichever dtype comes first."""
    case = make_case(m, 16, 64, torch.float16, interpret)
    u8 = case.codes
    i8 = u8.view(torch.int8)
    assert (i8 < 0).any()
    y_i8 = tilefuse.vq_matmul(case.x, i8, case.codebooks, case.scales)
    y_u8 = tilefuse.vq_matmul(case.x, u8, case.codebooks, case.scales)
    assert torch.equal(y_u8, y_i8)
    _check(y_u8, case, vq_op.choose_variant(m))


@pytest.mark.parametrize("m", [1, 2, 3, 17, 200])
def test_public_op_batch_dims_and_dispatch(interpret, m):
    """x: [..., K] with leading dims; the path is the cost model's for (M, N, K) (a layer this
    small: the small-layer kernel up to its token limit, dequant + GEMM above; N and K not multiples
    of 128: dequant + GEMM), checked with its tolerance."""
    assert vq_op.configs.decide(m, 24, 64, False).variant == "dequant"
    case = make_case(m, 128, 128, torch.float16, interpret, bias=True)
    x3 = case.x.reshape(1, m, 128)
    y = tilefuse.vq_matmul(x3, case.codes, case.codebooks, case.scales, case.bias)
    assert y.shape == (1, m, 128)
    variant = vq_op.choose_variant(m, 128, case.x.device, 128)
    small = m <= vq_op.configs.SMALL_MAX_TOKENS
    assert variant == vq_op.configs.decide(m, 128, 128, False).variant == ("small" if small else "dequant")
    _check(y.reshape(m, 128), case, variant)
    with tilefuse.force(variant="mma"):
        _check(tilefuse.vq_matmul(x3, case.codes, case.codebooks, case.scales, case.bias).reshape(m, 128), case, "mma")


def test_cost_model_picks_deterministic_cached_and_never_below_the_margin():
    """``configs.decide``: per (M, N, K) the fastest predicted kernel that takes M tokens, over
    dequant + cuBLAS only by ``configs.MARGIN``; the same object on a second call (cached)."""
    decide = vq_op.configs.decide
    decide.cache_clear()
    first = decide(7, 4096, 4096, True)
    assert decide(7, 4096, 4096, True) is first and decide.cache_info().hits == 1
    assert [decide(m, 28672, 8192, True).variant for m in (1, 8, 64)] == ["decode", "mma", "prefill"]
    assert decide(64, 28672, 8192, False).variant in ("mma", "dequant")      # no WGMMA kernel: no prefill
    assert decide(4096, 28672, 8192, True).variant == "dequant"              # past the kernels' ranges
    for m, n, k in ((1, 1152, 896), (16, 4096, 4096), (128, 5120, 3200), (333, 9216, 16384), (512, 1536, 192)):
        choice = decide(m, n, k, True)
        times = {c.variant: c.predicted_us for c in choice.candidates}
        assert all(t is None or t > 0 for t in times.values())
        if choice.variant != "dequant":
            assert times[choice.variant] * (1 + vq_op.configs.MARGIN) < times["dequant"]
            rank = {v: t / (1 + vq_op.configs.SMALL_BIAS) if v == "small" and t else t for v, t in times.items()}
            assert rank[choice.variant] == min(t for v, t in rank.items() if t is not None and v != "dequant")


def test_default_dispatch_switch_points():
    """The measured switch points (``configs.default_variant``): the WGMMA prefill kernel where it
    runs from 17 tokens up to PREFILL_MAX_TOKENS, dequant + cuBLAS above and where it does not."""
    dv = vq_op.configs.default_variant
    assert [dv(m) for m in (1, 2, 3, 16, 17, 512)] == ["decode", "decode", "mma", "mma", "dequant", "dequant"]
    assert [dv(m, True) for m in (16, 17, 128, 512, 513)] == ["mma", "prefill", "prefill", "prefill", "dequant"]


@pytest.mark.parametrize("m,n,k", [(17, 4096, 4096), (64, 4096, 14336), (128, 28672, 8192), (512, 4096, 4096),
                                   (512, 28672, 8192), (1, 1, 64)])
def test_wgmma_prefill_config(m, n, k):
    """The prefill grid covers every token, row and K step once; K is split only while the tiles
    leave SMs idle; the x ring and the codebook copies fit the shared-memory budget."""
    cfg = vq_op.configs.wgmma_prefill_config(m, n, k, 132)
    tm, tn, splits = cfg["grid"]
    assert tm * cfg["block_m"] >= m and tn * cfg["block_n"] >= n and cfg["block_n"] == 16 * cfg["num_warps"]
    per_split = cfg["groups_per_split"]
    assert splits == cfg["split_k"] and (splits - 1) * per_split < k // 8 <= splits * per_split
    assert cfg["groups_per_split"] % 8 == 0
    assert splits == 1 or tm * tn < 132
    assert 65536 + cfg["stages"] * cfg["block_m"] * 128 <= vq_op.configs.WGMMA_PREFILL_SMEM


def test_wide_codes_are_narrowed_and_checked(interpret):
    case = make_case(1, 8, 64, torch.float16, interpret)
    wide = case.codes.to(torch.int32)
    y = tilefuse.vq_matmul(case.x, wide, case.codebooks, case.scales, check_contents=True)
    _check(y, case, "small")
    wide[0, 0, 1] = 256
    with pytest.raises(ValueError, match="codes"):
        tilefuse.vq_matmul(case.x, wide, case.codebooks, case.scales, check_contents=True)


def test_wide_code_checks_under_compile_and_on_meta_tensors():
    """``check_contents=True`` with wide codes under ``torch.compile(fullgraph=True)`` (no
    data-dependent guard: the read is skipped while tracing) and on meta tensors (shapes)."""
    case = make_case(3, 16, 64, torch.float32, "cpu")
    wide = case.codes.to(torch.int32)

    def fn(x, codes, books, scales):
        return tilefuse.vq_matmul(x, codes, books, scales, check_contents=True)

    eager = fn(case.x, wide, case.codebooks, case.scales)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(case.x, wide, case.codebooks, case.scales)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    y = fn(*(t.to("meta") for t in (case.x, wide, case.codebooks, case.scales)))
    assert y.shape == (3, 16) and y.device.type == "meta"


def test_reference_backend_on_cpu(device):
    case = make_case(3, 8, 64, torch.float16, device)
    with tilefuse.force(backend="reference"):
        y = tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales)
    _check(y, case, "prefill")


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.randn(1, 60).half()), "x"),                        # K not a multiple of 8
    (dict(x=torch.randn(1, 64).int()), "x"),                         # integer input
    (dict(codebooks=torch.randn(2, 256, 1, 4).half()), "codebooks"),  # 2x8 only
    (dict(codebooks=torch.randn(1, 256, 1, 8).half()), "codebooks"),
    (dict(codebooks=torch.randn(2, 65536, 1, 8).half()), "codebooks"),  # 1x16 format: not this op
    (dict(codes=torch.zeros(8, 7, 2, dtype=torch.uint8)), "codes"),  # K/8 mismatch
    (dict(codes=torch.zeros(8, 8, 1, dtype=torch.uint8)), "codes"),
    (dict(codes=torch.zeros(8, 8, 2)), "codes"),                     # float codes
    (dict(scales=torch.ones(7, 1, 1, 1)), "scales"),
    (dict(bias=torch.zeros(9)), "bias"),
])
def test_errors(bad, match):
    args = dict(x=torch.randn(1, 64).half(), codes=torch.zeros(8, 8, 2, dtype=torch.uint8),
                codebooks=torch.zeros(2, 256, 1, 8).half(), scales=torch.ones(8, 1, 1, 1).half(), bias=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        tilefuse.vq_matmul(**args)


def test_debug_env_checks_wide_codes(monkeypatch):
    from tilefuse import _env

    monkeypatch.setenv("TILEFUSE_DEBUG", "1")
    _env.reload()
    try:
        codes = torch.full((8, 8, 2), -1, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"codes: expected values in \[0, 256\)"):
            tilefuse.vq_matmul(torch.randn(1, 64).half(), codes, torch.zeros(2, 256, 1, 8).half(), torch.ones(8))
    finally:
        monkeypatch.delenv("TILEFUSE_DEBUG")
        _env.reload()


def test_forced_variant_is_validated():
    with pytest.raises(ValueError, match="variant: expected one of"):
        with tilefuse.force(variant="nope"):
            pass


# ---------------------------------------------------------------- GPU (H200): bench shapes
GPU_SHAPES = SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("variant,m", [("decode", 1), ("decode", 8), ("dequant", 16), ("dequant", 512), ("prefill", 64),
                                       ("prefill", 512)])
def test_gpu_bench_shapes(dtype, n, k, variant, m):
    case = make_case(m, n, k, dtype, "cuda", bias=True)
    _check(_run_poisoned(case, variant), case, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", GPU_SHAPES + [(4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("m", [2, 3, 8, 16, 64])
def test_gpu_mma_bench_shapes(dtype, n, k, m):
    """The Gluon MMA decode kernel (default at 2-16 tokens), forced, at the bench shapes."""
    case = make_case(m, n, k, dtype, "cuda", bias=True)
    _check(_run_poisoned(case, "mma_gluon"), case, "mma")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(2, 1, 64), (5, 37, 1032), (16, 333, 8200), (9, 1000, 4104), (40, 129, 2056)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.int8])
def test_gpu_mma_edges(m, n, k, dtype, codes_dtype):
    """Odd N, K/8 not a multiple of the K step (masked tail), int8 codes, token tiles (40)."""
    case = make_case(m, n, k, dtype, "cuda", bias=True, codes_dtype=codes_dtype)
    _check(_run_poisoned(case, "mma_gluon"), case, "mma")
    for split_k in (1, 5):
        out = poisoned((m, n), dtype, "cuda")
        vq_op.launch_mma(*_args(case), out, impl="gluon", split_k=split_k)
        _check(out, case, "mma")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_mma_fp32_codebooks_and_nan(dtype):
    """fp32 codebooks (rounded to x's dtype in shared memory); NaN in unused entries stays out."""
    case = make_case(8, 4096, 4096, dtype, "cuda")
    case.codebooks = case.codebooks.float()
    _check(_run_poisoned(case, "mma_gluon"), case, "dequant")   # two roundings per weight: dequant's bound
    case.codes.clamp_(max=200)
    case.codebooks[:, 250] = float("nan")
    _check(_run_poisoned(case, "mma_gluon"), case, "dequant")


@pytest.mark.gpu
@pytest.mark.parametrize("variant,m", [("decode", 1), ("decode", 4), ("decode_resident", 2), ("decode_gather", 8),
                                       ("decode_tl", 3), ("mma", 3), ("mma_gluon", 16), ("prefill_tl", 24),
                                       ("prefill_wgmma", 64), ("prefill_wgmma", 512), ("dequant", 40)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1032)])
def test_gpu_codebook_sums_beyond_fp16_range(variant, m, n, k):
    """fp16 codebooks whose C0[a] + C1[b] exceeds 65504 with small scaled weights, on every path
    (the MMA and prefill kernels used to return NaN here while decode and dequant were right).
    The WGMMA prefill kernel (K a multiple of 64) runs in both forms; K = 1032 takes the odd-K
    paths (``prefill_wgmma`` then falls back to the tl kernel: skipped)."""
    if variant == "prefill_wgmma" and k % 64:
        pytest.skip("the WGMMA prefill kernel needs K a multiple of 64")
    if variant == "decode_resident" and (k // 8) % 2:
        pytest.skip("the resident decode needs K a multiple of 16")
    case = make_overflow_case(m, n, k, torch.float16, "cuda", bias=True)
    _check(_run_poisoned(case, variant), case, variant)
    if variant == "prefill_wgmma":
        out = poisoned((m, n), torch.float16, "cuda")
        vq_op.launch_prefill(*_args(case), out, impl="wgmma", ws=1 - vq_op.configs.WGMMA_PREFILL["ws"])
        _check(out, case, "prefill")
    with tilefuse.force(backend="triton"):      # the default dispatch at these tokens
        _check(tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales, case.bias), case, "dequant")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant,m", [("mma_gluon", 8), ("prefill_tl", 24), ("prefill_wgmma", 64)])
def test_gpu_fp32_codebooks_beyond_x_range(dtype, variant, m):
    """fp32 codebooks with entries of order 2^40 (fp16: beyond its range) and tiny scales: the MMA
    and prefill kernels scale the codebook copies by a power of two before rounding them to x's
    dtype. bf16 x: no overflow, the factor stays 1 (the same check of the common path)."""
    case = make_overflow_case(m, 4096, 4096, dtype, "cuda", codebooks_dtype=torch.float32, shift=40)
    _check(_run_poisoned(case, variant), case, "dequant")     # two roundings per weight: dequant's bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", GPU_SHAPES + [(4096, 14336), (14336, 4096)])
@pytest.mark.parametrize("m", [17, 64, 512])
def test_gpu_prefill_wgmma_bench_shapes(dtype, n, k, m):
    """The WGMMA prefill kernel (Hopper; default from 17 tokens), forced, at the bench shapes, in
    both forms (one partition, warp-specialized)."""
    case = make_case(m, n, k, dtype, "cuda", bias=True)
    _check(_run_poisoned(case, "prefill_wgmma"), case, "prefill")         # the measured form
    out = poisoned((m, n), dtype, "cuda")
    vq_op.launch_prefill(*_args(case), out, impl="wgmma", ws=1 - vq_op.configs.WGMMA_PREFILL["ws"])  # the other
    _check(out, case, "prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (33, 37, 1024), (300, 333, 8192), (129, 1000, 4096), (70, 200, 640)])
@pytest.mark.parametrize("tiles", [dict(block_m=64, num_warps=4), dict(block_m=128, num_warps=8),
                                   dict(block_m=256, num_warps=8, stages=3), dict(block_m=64, ws=1),
                                   dict(block_m=256, ws=1, stages=3)],
                         ids=["64x64", "128x128", "256x128", "ws-64x128", "ws-256x128"])
@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.int8])
def test_gpu_prefill_wgmma_edges(m, n, k, tiles, codes_dtype):
    """Odd N (clamped rows), M not a multiple of the token tile (TMA zero fill), one K step, every
    tile shape, int8 codes, x at an unaligned offset (copied for TMA), bias and no bias."""
    for dtype, bias in ((torch.float16, True), (torch.bfloat16, False)):
        case = make_case(m, n, k, dtype, "cuda", bias=bias, codes_dtype=codes_dtype)
        out = poisoned((m, n), dtype, "cuda")
        vq_op.launch_prefill(*_args(case), out, impl="wgmma", **tiles)
        _check(out, case, "prefill")
    shifted = torch.empty(m * k + 1, dtype=case.x.dtype, device="cuda")[1:].view(m, k)
    shifted.copy_(case.x)
    out = poisoned((m, n), case.x.dtype, "cuda")
    vq_op.launch_prefill(shifted, *_args(case)[1:], out, impl="wgmma", **tiles)
    _check(out, case, "prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_prefill_wgmma_fp32_codebooks_nan_and_graph(dtype):
    """fp32 codebooks (rounded to x's dtype in shared memory); NaN in unused entries stays out; the
    default dispatch at 64 tokens is this kernel and replays in a CUDA graph."""
    case = make_case(64, 4096, 4096, dtype, "cuda")
    case.codebooks = case.codebooks.float()
    case.codes.clamp_(max=200)
    case.codebooks[:, 250] = float("nan")
    _check(_run_poisoned(case, "prefill_wgmma"), case, "dequant")   # two roundings per weight: dequant's bound
    assert vq_op.choose_variant(64, 4096, case.x.device) == "prefill"
    fn = lambda: tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales)  # noqa: E731
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, case, "dequant")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpu_decode_resident(dtype, n, k, m):
    """The shared-memory-resident table kernel (default decode for 1-4 tokens, K % 16 == 0)."""
    case = make_case(m, n, k, dtype, "cuda", bias=True)
    _check(_run_poisoned(case, "decode_resident"), case, "decode")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (3, 37, 1040), (1, 37, 528), (2, 1000, 4112), (4, 333, 8208)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_decode_resident_edges(m, n, k, bias):
    """Partial K slices (K/8 not a multiple of 64 / M_PAD groups), N = 1 and odd N, 3 tokens."""
    case = make_case(m, n, k, torch.bfloat16, "cuda", bias=bias)
    _check(_run_poisoned(case, "decode_resident"), case, "decode")


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 1032), (8, 4096)])
def test_gpu_decode_gather(m, k):
    """The gl.gather kernel: decode for 5-8 tokens and for K/8 odd."""
    case = make_case(m, 1000, k, torch.bfloat16, "cuda", bias=True)
    assert not vq_op.resident_applies(m, k, case.x.device)
    _check(_run_poisoned(case, "decode_gather"), case, "decode")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_decode_tl(dtype, m):
    case = make_case(m, 1000, 1032, dtype, "cuda", bias=True)
    _check(_run_poisoned(case, "decode_tl"), case, "decode_tl")


@pytest.mark.gpu
@pytest.mark.parametrize("m,dtype,variant", [(1, torch.float16, "decode"), (3, torch.bfloat16, "mma"),
                                             (8, torch.bfloat16, "mma"), (16, torch.bfloat16, "mma")])
def test_gpu_cuda_graph_replays(m, dtype, variant):
    """The split-K workspace protocol of the default decode kernels survives graph replay (no
    zeroing launch inside); a stale workspace would add the previous call's sums. fp32 atomics
    land in any order, so replays may differ from each other in the last bits, never by a call."""
    case = make_case(m, 4096, 4096, dtype, "cuda")
    assert vq_op.choose_variant(m) == variant
    if variant == "decode":
        assert vq_op.configs.resident_config(1, 4096, 4096, 132)["k_slices"] > 1
    fn = lambda: tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales)  # noqa: E731
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, case, variant)


def test_gluon_kernels_resolve_once():
    """The launchers' kernel lookups (GPU-only paths) resolve on any machine with Triton 3.6, once."""
    assert vq_op._gluon_decode() is not None and vq_op._resident_decode() is not None
    assert vq_op._resident_decode() is vq_op._resident_decode()
    assert vq_op._resident_decode().fn.__name__ == "vq_decode_resident_kernel"


# ---------------------------------------------------------------- gradients, NaN, dtypes, sizes
def test_gradcheck():
    """The registered backward (x, codebooks, scales, bias) against finite differences (fp64)."""
    codes = torch.randint(0, 4, (5, 2, 2), dtype=torch.uint8)       # few distinct codes: shared entries
    books = torch.randn(2, 256, 1, 8, dtype=torch.float64, requires_grad=True)
    scales = (torch.rand(5, 1, 1, 1, dtype=torch.float64) + 0.5).requires_grad_()
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, c, s, b: tilefuse.vq_matmul(x, codes, c, s, b),
                                    (x, books, scales, bias), fast_mode=True)


@pytest.mark.parametrize("variant", ["decode", "mma", "dequant"])
def test_kernel_path_gradients(interpret, variant):
    case = make_case(2, 24, 64, torch.float16, interpret, bias=True)
    x = case.x.clone().requires_grad_()
    with tilefuse.force(variant=variant):
        y = tilefuse.vq_matmul(x, case.codes, case.codebooks, case.scales, case.bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = vq_op.dequantize(case.codes, case.codebooks, case.scales, dtype=torch.float64)
    assert_close(x.grad, dy.double() @ w, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("variant", ["decode", "decode_tl", "mma", "dequant"])
def test_nan_in_an_unused_codebook_entry_never_leaks(interpret, variant):
    """NaN in entries no code uses: the spec ignores them, so must every kernel (no 0 x NaN)."""
    case = make_case(2, 24, 128, torch.float16, interpret)
    case.codes.clamp_(max=200)
    case.codebooks[:, 250] = float("nan")
    _check(_run_poisoned(case, {"decode_tl": "decode_tl"}.get(variant, variant)), case, variant)


@pytest.mark.parametrize("variant", ["decode", "decode_tl", "mma", "prefill", "dequant"])
@pytest.mark.parametrize("m,n,k", [(4, 24, 128), (8, 37, 264)])
def test_codebook_sums_beyond_fp16_range(interpret, variant, m, n, k):
    """fp16 codebooks whose C0[a] + C1[b] exceeds 65504 while the scaled weight is small: the
    reference (fp32 sums, then the scale) is finite, and so must every kernel be (the MMA kernels
    round C0 + C1 to x's dtype: they scale the codebooks by a power of two, the row scale back)."""
    case = make_overflow_case(m, n, k, torch.float16, interpret, bias=True)
    _check(_run_poisoned(case, variant), case, variant)


@pytest.mark.parametrize("shift", [16, 40])
def test_fp32_codebooks_beyond_fp16_range_on_the_mma_path(interpret, shift):
    """fp32 codebooks with entries of order 2^shift (beyond fp16's range), x fp16, tiny scales: the
    MMA kernel's power-of-two factor brings them into fp16's range (the public op at 3-16 tokens)."""
    case = make_overflow_case(5, 24, 128, torch.float16, interpret, codebooks_dtype=torch.float32, shift=shift)
    assert case.codebooks.abs().max() > 65504
    y = tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales)
    assert vq_op.choose_variant(5) == "mma"
    _check(y, case, "mma")


def test_nan_in_x_propagates(interpret):
    case = make_case(2, 24, 64, torch.float16, interpret)
    case.x[1, 5] = float("nan")
    y = tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


def test_fp32_codebooks_from_the_quantizer_are_taken(interpret):
    """quantize() returns fp32 codebooks: fp16 activations (kernels) and fp32 ones (reference)."""
    case = make_case(1, 16, 64, torch.float16, interpret)
    case.codebooks = case.codebooks.float()
    _check(tilefuse.vq_matmul(case.x, case.codes, case.codebooks, case.scales), case, "small")
    y32 = tilefuse.vq_matmul(case.x.float(), case.codes, case.codebooks, case.scales.float())
    assert y32.dtype == torch.float32
    assert_close(y32, reference_fp64(case), atol=1e-5, rtol=1e-5)


def test_zero_sizes(interpret):
    x = torch.randn(3, 0, dtype=torch.float16, device=interpret)
    bias = torch.randn(5, dtype=torch.float16, device=interpret)
    y = tilefuse.vq_matmul(x, torch.zeros(5, 0, 2, dtype=torch.uint8, device=interpret),
                           torch.randn(2, 256, 1, 8, dtype=torch.float16, device=interpret),
                           torch.ones(5, 1, 1, 1, dtype=torch.float16, device=interpret), bias)
    assert torch.equal(y, bias.expand(3, 5))
    y = tilefuse.vq_matmul(torch.randn(3, 16, dtype=torch.float16, device=interpret),
                           torch.zeros(0, 2, 2, dtype=torch.uint8, device=interpret),
                           torch.randn(2, 256, 1, 8, dtype=torch.float16, device=interpret),
                           torch.ones(0, 1, 1, 1, dtype=torch.float16, device=interpret))
    assert y.shape == (3, 0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_no_tokens(backend, dtype, lead, device):
    """x with no tokens (an MoE expert no token was routed to): an empty ``[..., N]`` output in x's
    dtype on x's device, as the reference gives, and ``explain`` says so (before: the cost
    model divided by M = 0 in host code, ZeroDivisionError)."""
    case = make_case(1, 24, 64, dtype, device, bias=True)
    x = torch.randn(*lead, 64, device=device).to(dtype)
    with tilefuse.force(backend=backend):
        y = tilefuse.vq_matmul(x, case.codes, case.codebooks, case.scales, case.bias)
        choice = tilefuse.explain(tilefuse.vq_matmul, x, case.codes, case.codebooks, case.scales, case.bias)
    assert y.shape == (*lead, 24) and y.dtype == dtype and y.device == x.device
    assert choice.problem["M"] == 0 and choice.variant in ("empty", "reference"), str(choice)
    # the registered op (a gradient asked for) and its backward: empty / zero gradients
    xg, books = x.detach().requires_grad_(), case.codebooks.float().requires_grad_()
    with tilefuse.force(backend=backend):
        out = tilefuse.vq_matmul(xg, case.codes, books, case.scales, case.bias)
    out.float().sum().backward()
    assert xg.grad.shape == x.shape and not books.grad.any()


def _compile_inputs(m, dtype, device):
    case = make_case(max(m, 1), 24, 64, dtype, device, bias=True)
    case.x = torch.randn(m, 64, device=device).to(dtype)
    return case


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_before_any_eager_call(backend, dynamic, device):
    """``torch.compile(vq_matmul, fullgraph=True)``, static and dynamic, as the first call of its
    shapes (no cached plan): the traced path reads metadata only and leaves the per-size pick to the
    op at run time (before: dynamic shapes failed on the cost model's sort of symbolic times, and a
    zero-token call on a ZeroDivisionError)."""
    dtype = torch.float16
    vq_op._plans.clear()
    torch._dynamo.reset()
    fn = torch.compile(tilefuse.vq_matmul, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    with tilefuse.force(backend=backend):
        for m in (3, 5, 0):
            case = _compile_inputs(m, dtype, device)
            y = fn(case.x, case.codes, case.codebooks, case.scales, case.bias)
            assert y.shape == (m, 24) and y.dtype == dtype
            if m:
                _check(y, case, "dequant")       # the loosest bound of the paths the pick may take


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_layer_fullgraph_before_any_eager_call(dynamic, interpret):
    """``VQLinear`` compiled whole-graph (static and dynamic), first call compiled, no tokens included."""
    vq_op._plans.clear()
    torch._dynamo.reset()
    layer = tilefuse.nn.VQLinear(64, 24, dtype=torch.float16).to(interpret)
    case = make_case(1, 24, 64, torch.float16, interpret, bias=True)
    layer.load_quantized(case.codes, case.codebooks, case.scales, case.bias)
    fn = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for lead in ((2, 3), (2, 5), (0, 7)):
        case.x = torch.randn(*lead, 64, device=interpret).half()
        y = fn(case.x)
        assert y.shape == (*lead, 24) and y.dtype == torch.float16
        if y.numel():
            case.x = case.x.reshape(-1, 64)
            _check(y.reshape(-1, 24), case, "dequant")


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_gpu_compile_and_graphs_with_no_tokens(dynamic):
    """On the GPU: ``vq_matmul`` and ``VQLinear`` under ``torch.compile(fullgraph=True)`` (inductor,
    static and dynamic, first calls compiled) at 0, 1, 5 and 40 tokens, and zero tokens captured in
    a CUDA graph."""
    vq_op._plans.clear()
    torch._dynamo.reset()
    case = make_case(1, 512, 1024, torch.bfloat16, "cuda", bias=True)
    layer = tilefuse.nn.VQLinear(1024, 512, dtype=torch.bfloat16, device="cuda")
    layer.load_quantized(case.codes, case.codebooks, case.scales, case.bias)
    op = torch.compile(tilefuse.vq_matmul, fullgraph=True, dynamic=dynamic)
    mod = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    for m in (1, 5, 40, 0):
        case.x = torch.randn(m, 1024, device="cuda").bfloat16()
        y = op(case.x, case.codes, case.codebooks, case.scales, case.bias)
        z = mod(case.x)
        assert y.shape == z.shape == (m, 512)
        if m:       # the loosest bound of the paths the pick may take
            _check(y, case, "dequant")
            _check(z, case, "dequant")
    x = torch.empty(0, 1024, device="cuda", dtype=torch.bfloat16)
    layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tilefuse.vq_matmul(x, case.codes, case.codebooks, case.scales, case.bias)
        z = layer(x[None])
    graph.replay()
    torch.cuda.synchronize()
    assert y.shape == (0, 512) and z.shape == (1, 0, 512)


def test_non_contiguous_weights_are_copied(interpret):
    case = make_case(2, 24, 64, torch.float16, interpret, bias=True)
    scales = torch.stack((case.scales.reshape(24), torch.zeros(24, dtype=torch.float16, device=interpret)), 1)[:, 0]
    bias = torch.stack((case.bias, case.bias), 1)[:, 1]
    assert not scales.is_contiguous() and not bias.is_contiguous()
    y = tilefuse.vq_matmul(case.x, case.codes, case.codebooks, scales, bias)
    _check(y, case, "decode")


def test_explain_names_the_cost_model(interpret):
    for m, variant in ((1, "small"), (5, "small"), (600, "dequant")):
        case = make_case(m, 4096, 1024, torch.float16, interpret)
        choice = tilefuse.explain(tilefuse.vq_matmul, case.x, case.codes, case.codebooks, case.scales.reshape(4096))
        assert (choice.family, choice.variant, choice.source) == ("vq", variant, "cost model"), str(choice)
        assert {c.variant for c in choice.candidates} == {"decode", "mma", "small", "dequant"}   # no WGMMA on a CPU
    case = make_case(3, 40, 64, torch.float16, interpret)
    with tilefuse.force(variant="dequant"):
        forced = tilefuse.explain("vq_matmul", case.x, case.codes, case.codebooks, case.scales.reshape(40))
    assert forced.source == "forced"
