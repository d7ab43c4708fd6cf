"""The fused 2-bit gate/up projection with the SwiGLU epilogue (``tilefuse.vq_swiglu``,
``tilefuse/ops/vq/kernels_swiglu.py``).

CPU: the ``tl`` twin in Triton's interpreter (fp16: the interpreter computes bf16 ``tl.dot``
wrongly) at shapes that cross steps, K slices and token tiles, into NaN-poisoned outputs; the
public op's paths (fused, the unfused path above 16 tokens, the fp32 reference, no tokens); bad
inputs; the Gluon kernel compiled for sm_90 (registers, spills, where the codebook copies sit).
GPU (@gpu): the Gluon kernel at MoE-expert and large-MLP shapes, fp16 and bf16, settings and odd
shapes, bit-identical repeats and graph replays.

Every comparison is against the spec evaluated in fp64 (``vq_swiglu_reference``). Tolerance
(:func:`_bound`): each projection as the small-layer kernel's (``testing.vq.tolerance(dtype,
"small")``: each weight ``C0[a] + C1[b]`` rounded once to x's dtype, fp32 sums) gives
``|dg| <= e_g = scale * (|x| @ |Wg|^T)`` and likewise ``e_u``; ``h = silu(g) u`` then moves by at most
``max|silu'| |u| e_g + |silu(g)| e_u + max|silu'| e_g e_u`` (``max|silu'| < 1.1``), plus one
rounding of h to x's dtype (``rtol``: one ulp, twice the half ulp the rounding can cost, which
covers the fp32 epilogue's few ulps of fp32). The unfused path (above 16 tokens) also rounds g and
u to x's dtype: ``e += ulp / 2 * |g|`` (and ``|u|``), each projection at the widest tolerance of
``vq_matmul``'s paths (``"dequant"``: the weight rounded with its scale, cuBLAS's reduced-precision sums).
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.vq import op as vq_op
from tilefuse.ops.vq.reference import dequantize, vq_swiglu_reference
from tilefuse.testing import assert_within, poisoned, repeats_and_replays_identical
from tilefuse.testing.vq import make_case, make_overflow_case, make_weight, tolerance

SILU_SLOPE = 1.1        # max |silu'(t)| = 1.0998 (at t = 2.4)


class _Case:
    """x [M, K], a gate and an up 2x8 weight [N, K] each with its own codebooks, optional biases."""

    def __init__(self, m, n, k, dtype, device, *, gate_bias=False, up_bias=False, codes_dtype=torch.uint8):
        gate = make_case(m, n, k, dtype, device, bias=gate_bias, codes_dtype=codes_dtype)
        self.x = gate.x
        self.gate = (gate.codes, gate.codebooks, gate.scales)
        self.up = make_weight(n, k, dtype, device, codes_dtype=codes_dtype)
        self.gate_bias = gate.bias
        self.up_bias = torch.randn(n, device=device).to(dtype) if up_bias else None

    def args(self, x=None):
        return (self.x if x is None else x, *self.gate, *self.up, self.gate_bias, self.up_bias)

    def flat_args(self):
        """launch_swiglu's: scales as [N]."""
        n = self.gate[0].shape[0]
        return (self.x, self.gate[0], self.gate[1], self.gate[2].reshape(n), self.up[0], self.up[1],
                self.up[2].reshape(n), self.gate_bias, self.up_bias)


def _projection(x, codes, books, scales, bias):
    """(g in fp64, |x| @ |W|^T in fp64) of one projection."""
    w = dequantize(codes, books.double(), scales.double(), dtype=torch.float64)
    out = x.double() @ w.T
    if bias is not None:
        out = out + bias.double()
    return out, x.double().abs() @ w.abs().T


def _bound(case, dtype, rounded=False):
    """(the fp64 reference h [M, N], the bound on |out - h| for x's dtype ``dtype``)."""
    tol = tolerance(dtype, "dequant" if rounded else "small")     # unfused: vq_matmul's widest path's
    ulp = tol["rtol"]
    g, scale_g = _projection(case.x, *case.gate, case.gate_bias)
    u, scale_u = _projection(case.x, *case.up, case.up_bias)
    e_g, e_u = tol["scale"] * scale_g, tol["scale"] * scale_u
    if rounded:
        e_g, e_u = e_g + ulp / 2 * g.abs(), e_u + ulp / 2 * u.abs()
    silu = g * torch.sigmoid(g)
    h = silu * u
    return h, ulp * h.abs() + SILU_SLOPE * u.abs() * e_g + silu.abs() * e_u + SILU_SLOPE * e_g * e_u


def _check(out, case, rounded=False):
    ref, bound = _bound(case, case.x.dtype if case.x.dtype != torch.float32 else torch.float16, rounded)
    want = vq_swiglu_reference(*case.args(case.x.double()), compute_dtype=torch.float64)
    assert torch.allclose(want.double(), ref, rtol=1e-12, atol=1e-12), "the spec and the test's fp64 h differ"
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert_within(out, ref, bound)


def _run(case, **override):
    m, n = case.x.shape[0], case.gate[0].shape[0]
    out = poisoned((m, n), case.x.dtype, case.x.device)
    vq_op.launch_swiglu(*case.flat_args(), out, **override)
    return out


# (M, N, K): N = 1, odd N, N not a multiple of 16, K/8 odd and not a multiple of the 4-group step
# (264 -> 33, 72 -> 9, 8 -> 1), token tiles (17)
CPU_SHAPES = [(1, 1, 64), (1, 37, 264), (2, 40, 136), (5, 16, 64), (16, 17, 520), (17, 33, 72), (3, 24, 8)]


@pytest.mark.parametrize("m,n,k", CPU_SHAPES)
@pytest.mark.parametrize("bias", ["none", "gate", "up", "both"])
@pytest.mark.parametrize("slices", [None, 1, 2, 4])
def test_swiglu_interpreted(interpret, m, n, k, bias, slices):
    case = _Case(m, n, k, torch.float16, interpret, gate_bias=bias in ("gate", "both"),
                 up_bias=bias in ("up", "both"), codes_dtype=torch.int8 if bias == "both" else torch.uint8)
    _check(_run(case, slices=slices), case)


def test_swiglu_two_row_tiles_and_8_token_tiles(interpret):
    case = _Case(11, 45, 136, torch.float16, interpret, gate_bias=True, up_bias=True)
    _check(_run(case, slices=2, row_tiles=2, tokens=8), case)


def test_swiglu_public_op_fused_batch_dims_and_no_tokens(interpret):
    """A size where vq_matmul would run the small-layer kernel (N, K multiples of 128): one fused
    launch; leading dims kept; no tokens give an empty output."""
    case = _Case(6, 128, 128, torch.float16, interpret, gate_bias=True, up_bias=True)
    x = case.x.reshape(2, 3, 128)
    y = tilefuse.vq_swiglu(*case.args(x))
    assert vq_op._plan_swiglu(*case.args(x)).fused
    assert y.shape == (2, 3, 128)
    _check(y.reshape(6, 128), case)
    for empty in (case.x[:0], case.x.reshape(2, 3, 128)[:, :0]):
        out = tilefuse.vq_swiglu(*case.args(empty))
        assert out.shape == (*empty.shape[:-1], 128) and out.dtype == torch.float16


def test_swiglu_fuses_where_vq_matmul_picks_the_small_kernel_or_it_is_forced(interpret):
    """Fused exactly where vq_matmul's own decision (or force) is the small-layer kernel: an odd
    size runs the two projections on their picks unless ``force(variant="small")``; another
    pinned variant runs both projections on it."""
    case = _Case(6, 24, 136, torch.float16, interpret, gate_bias=True, up_bias=True)
    assert vq_op.choose_variant(6, 136, case.x.device, 24) != "small"
    assert not vq_op._plan_swiglu(*case.args()).fused
    _check(tilefuse.vq_swiglu(*case.args()), case, rounded=True)
    with tilefuse.force(variant="small"):
        assert vq_op._plan_swiglu(*case.args()).fused
        _check(tilefuse.vq_swiglu(*case.args()), case)
    big = _Case(2, 128, 128, torch.float16, interpret)
    with tilefuse.force(variant="dequant"):
        assert not vq_op._plan_swiglu(*big.args()).fused
        _check(tilefuse.vq_swiglu(*big.args()), big, rounded=True)


def test_swiglu_public_op_above_16_tokens_runs_the_projections_unfused(interpret):
    case = _Case(19, 40, 64, torch.float16, interpret, gate_bias=True)
    assert not vq_op._plan_swiglu(*case.args()).fused
    _check(tilefuse.vq_swiglu(*case.args()), case, rounded=True)


def test_swiglu_fp32_and_reference_backend():
    """fp32 x (any device) and the reference backend run the spec (fp32 compute)."""
    case = _Case(5, 24, 64, torch.float32, "cpu", gate_bias=True, up_bias=True)
    out = tilefuse.vq_swiglu(*case.args())
    assert out.dtype == torch.float32
    want = vq_swiglu_reference(*case.args(case.x.double()), compute_dtype=torch.float64)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    half = _Case(3, 16, 64, torch.float16, "cpu")
    with tilefuse.force(backend="reference"):
        _check(tilefuse.vq_swiglu(*half.args()), half)


def test_swiglu_wide_codes_are_narrowed(interpret):
    case = _Case(2, 24, 64, torch.float16, interpret, up_bias=True)
    wide = list(case.args())
    wide[1], wide[4] = case.gate[0].to(torch.int32), case.up[0].to(torch.int64)
    _check(tilefuse.vq_swiglu(*wide, check_contents=True), case)


def test_swiglu_codebook_sums_beyond_fp16_range(interpret):
    """The gate's fp16 codebooks' sums overflow fp16: scaled by a power of two, the row scale back;
    the up's are not (each weight its own factor)."""
    case = _Case(3, 40, 264, torch.float16, interpret, gate_bias=True)
    big = make_overflow_case(3, 40, 264, torch.float16, interpret)
    case.x = big.x
    case.gate = (big.codes, big.codebooks, big.scales)
    _check(_run(case, slices=2), case)
    case.gate, case.up = case.up, case.gate
    _check(_run(case, slices=2), case)


def test_swiglu_nan_in_x_propagates(interpret):
    case = _Case(2, 24, 64, torch.float16, interpret)
    case.x[1, 5] = float("nan")
    out = _run(case)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_swiglu_no_backward(interpret):
    case = _Case(2, 16, 64, torch.float16, interpret)
    x = case.x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward"):
        tilefuse.vq_swiglu(*case.args(x)).sum().backward()


# ------------------------------------------------------------------------------------- bad input
def _bad(case, **change):
    names = ("x", "gate_codes", "gate_codebooks", "gate_scales", "up_codes", "up_codebooks", "up_scales",
             "gate_bias", "up_bias")
    args = dict(zip(names, case.args()))
    args.update(change)
    return args


@pytest.mark.parametrize("name,make", [
    ("x", lambda c: c.x.to(torch.int32)),
    ("x", lambda c: c.x[:, :60]),
    ("gate_codes", lambda c: c.gate[0][:, :4]),
    ("gate_codes", lambda c: c.gate[0].float()),
    ("up_codes", lambda c: c.up[0][:8]),                     # N differs from the gate's
    ("up_codes", lambda c: c.up[0][:, :4]),                  # K differs from x's
    ("gate_codebooks", lambda c: c.gate[1][:, :128]),
    ("up_codebooks", lambda c: c.up[1].reshape(2, 256, 8)),
    ("gate_scales", lambda c: c.gate[2][:8]),
    ("up_scales", lambda c: c.up[2].to(torch.int32)),
    ("gate_bias", lambda c: torch.zeros(8, dtype=torch.float16)),
    ("up_bias", lambda c: torch.zeros(16, dtype=torch.int32)),
    ("up_scales", lambda c: c.up[2].to("meta")),             # another device
    ("gate_codebooks", lambda c: [0.0] * 4096),
])
def test_swiglu_bad_input_names_the_argument(name, make):
    case = _Case(2, 16, 64, torch.float16, "cpu")
    with pytest.raises(ValueError, match=f"^{name}: "):
        tilefuse.vq_swiglu(**_bad(case, **{name: make(case)}))


def test_swiglu_wide_codes_out_of_range_name_the_argument():
    case = _Case(2, 16, 64, torch.float16, "cpu")
    for name, codes in (("gate_codes", case.gate[0]), ("up_codes", case.up[0])):
        wide = codes.to(torch.int32)
        wide[0, 0, 0] = 256
        with pytest.raises(ValueError, match=f"^{name}: expected values in"):
            tilefuse.vq_swiglu(**_bad(case, **{name: wide}), check_contents=True)


def test_launch_swiglu_refuses_unknown_impl_and_gluon_off_the_gpu(interpret):
    case = _Case(1, 16, 64, torch.float16, interpret)
    out = torch.empty(1, 16, dtype=torch.float16, device=interpret)
    with pytest.raises(ValueError, match="^impl: "):
        vq_op.launch_swiglu(*case.flat_args(), out, impl="wgmma")
    if interpret.type == "cpu":
        with pytest.raises(ValueError, match="^impl: "):
            vq_op.launch_swiglu(*case.flat_args(), out, impl="gluon")


def test_swiglu_is_a_registered_op_with_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = _Case(3, 16, 64, torch.float16, "cpu", gate_bias=True)
    with FakeTensorMode() as mode:
        fake = [None if t is None else mode.from_tensor(t) for t in case.args()]
        out = torch.ops.tilefuse.vq_swiglu(*fake)
    assert out.shape == (3, 16) and out.dtype == torch.float16


# ------------------------------------------------------------------ Gluon compile checks (CPU)
def _compile(dtype, m, n, k, **override):
    from tilefuse.ops.vq import configs
    from tilefuse.testing.gluon import compile_gluon_isolated

    override.setdefault("copies", vq_op.SWIGLU_COPIES)
    cfg = configs.small_config(m, n, k, True, 132, **override)
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    pointers = ("x_ptr", "g_codes_ptr", "g_cb_ptr", "g_scales_ptr", "g_bias_ptr", "u_codes_ptr", "u_cb_ptr",
                "u_scales_ptr", "u_bias_ptr", "out_ptr")
    signature = dict(zip(pointers, (element, "*i16", element, element, element, "*i16", element, element,
                                    element, element)))
    ints = dict(M=m, N=n, NUM_GROUPS=k // 8, GROUPS_PER_SLICE=cfg["groups_per_slice"], stride_xm=k, stride_cn=k // 8,
                stride_om=n)     # the values op._swiglu_call passes
    signature.update({name: "i32" for name in ints})
    constexprs = dict(TOKENS=cfg["tokens"], KREP=cfg["krep"], ROW_TILES=cfg["row_tiles"], SLICES=cfg["slices"],
                      COPIES=cfg["copies"], GATE_BIAS=True, UP_BIAS=True, EVEN=cfg["even"])
    signature.update({name: "constexpr" for name in constexprs})
    aligned = list(pointers) + [name for name, value in ints.items() if value % 16 == 0]
    return cfg, compile_gluon_isolated("tilefuse.ops.vq.kernels_swiglu:vq_swiglu_kernel", signature, constexprs,
                                       num_warps=cfg["num_warps"], aligned=aligned)


@pytest.mark.parametrize("dtype,m,n,k,override", [
    (torch.float16, 1, 2048, 768, {}), (torch.bfloat16, 16, 768, 2048, {}), (torch.float16, 8, 14336, 4096, {}),
    (torch.bfloat16, 3, 37, 264, dict(slices=2, copies=2, krep=2)), (torch.float16, 16, 1024, 4096, dict(copies=8)),
    (torch.bfloat16, 5, 129, 2056, dict(slices=4, copies=2, row_tiles=2)),
    (torch.float16, 40, 333, 8200, dict(slices=2, copies=1, tokens=8)), (torch.float16, 1, 1, 64, dict(slices=8, krep=2))])
def test_swiglu_kernel_compiles(dtype, m, n, k, override):
    """No spills; the codebook copies (both weights', one buffer) are the first shared store, at
    ``global_smem`` + 0 (the lookups' PTX addresses them there); two MMAs per step; no atomics."""
    from tilefuse.testing.gluon import first_shared_store_offset

    cfg, result = _compile(dtype, m, n, k, **override)
    assert result.spilled == 0, result.ptxas
    assert 0 < result.registers <= 255 and result.shared <= 232448
    assert result.shared >= 4 * 256 * cfg["copies"] * 16           # four codebooks' copies
    assert "mma.sync" in result.ptx and "global_smem" in result.ptx and "ex2" in result.ptx
    assert first_shared_store_offset(result.ptx) == 0
    assert str(512 * cfg["copies"] * 16) in result.ptx       # the up weight's lookups: its copies' byte offset
    assert ("%tid.x" in result.ptx) or cfg["slices"] == 1
    assert "red.global" not in result.ptx and "atom.global" not in result.ptx      # no split over programs


# ------------------------------------------------------------------------------------- GPU
# MoE experts (Qwen3-30B-A3B: hidden 2048, expert intermediate 768; OLMoE 2048 x 1024), a small
# dense MLP, and Llama-3-8B's / Mistral-7B's gate/up (14336 x 4096)
GPU_LAYERS = [(768, 2048), (2048, 768), (1024, 2048), (1536, 2048), (14336, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_LAYERS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_swiglu_layers(n, k, m, dtype):
    case = _Case(m, n, k, dtype, "cuda", gate_bias=m % 2 == 0, up_bias=m % 2 == 0)
    _check(_run(case, impl="gluon"), case)
    _check(tilefuse.vq_swiglu(*case.args()), case)


@pytest.mark.gpu
@pytest.mark.parametrize("override", [dict(slices=2, tokens=8), dict(slices=2, copies=1), dict(slices=4, copies=2, krep=2),
                                      dict(slices=8, copies=8), dict(tokens=16, copies=4), dict(slices=8, krep=2),
                                      dict(slices=4, copies=2, row_tiles=2)])
@pytest.mark.parametrize("m,n,k", [(1, 2048, 768), (7, 768, 2048), (16, 1024, 4096), (3, 37, 1032), (9, 333, 8200),
                                   (40, 129, 2056), (1, 1, 64)])
@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.int8])
def test_gpu_swiglu_settings_and_edges(override, m, n, k, codes_dtype):
    """Settings, odd N, K/8 odd and not a multiple of the step or of the slices (masked tails),
    token tiles (40), int8 codes; both dtypes."""
    for dtype in (torch.float16, torch.bfloat16):
        case = _Case(m, n, k, dtype, "cuda", gate_bias=True, up_bias=m % 2 == 1, codes_dtype=codes_dtype)
        _check(_run(case, impl="gluon", **override), case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_swiglu_fp32_codebooks_overflow_and_unfused(dtype):
    case = _Case(8, 2048, 768, dtype, "cuda", gate_bias=True)
    case.gate = (case.gate[0], case.gate[1].float(), case.gate[2])
    _check(_run(case, impl="gluon"), case)
    big = make_overflow_case(5, 768, 2048, torch.float16, "cuda")
    case = _Case(5, 768, 2048, torch.float16, "cuda", up_bias=True)
    case.x, case.gate = big.x, (big.codes, big.codebooks, big.scales)
    _check(_run(case, impl="gluon"), case)
    case = _Case(300, 768, 2048, dtype, "cuda", gate_bias=True, up_bias=True)     # past the small kernel: unfused
    assert not vq_op._plan_swiglu(*case.args()).fused
    _check(tilefuse.vq_swiglu(*case.args()), case, rounded=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", [(768, 2048), (14336, 4096)])
def test_gpu_swiglu_bit_identical_repeats_and_graph_replays(m, n, k):
    """No atomics: every launch, eager or replayed, gives the same bits."""
    case = _Case(m, n, k, torch.bfloat16, "cuda", gate_bias=True, up_bias=True)
    with tilefuse.force(variant="small"):      # the fused kernel at every size (14336 x 4096 too)
        first = repeats_and_replays_identical(lambda: tilefuse.vq_swiglu(*case.args()))
    _check(first, case)


@pytest.mark.gpu
def test_gpu_swiglu_matches_two_vq_matmuls():
    """Against the unfused form a model runs today (two vq_matmul calls, then SiLU * up in fp32):
    within the rounding of g and u to x's dtype."""
    case = _Case(4, 768, 2048, torch.bfloat16, "cuda", gate_bias=True, up_bias=True)
    g = tilefuse.vq_matmul(case.x, *case.gate, case.gate_bias).float()
    u = tilefuse.vq_matmul(case.x, *case.up, case.up_bias).float()
    _check((g * torch.sigmoid(g) * u).to(torch.bfloat16), case, rounded=True)
    _check(tilefuse.vq_swiglu(*case.args()), case)


def test_fused_decision_picks_the_faster_path_of_the_committed_sweep():
    """``configs.decide_swiglu`` on every size and token count of the committed H100 sweep
    (``tools/vq_small_sweep.py --swiglu``): where it fuses, the fused kernel (timed forced) is no
    slower than two ``vq_matmul`` calls plus PyTorch's SiLU·mul (an upper bound of the unfused
    path, whose epilogue is one pass); where it does not, the unfused path as the dispatch ran it
    is no slower than the fused kernel forced. 5 %: timing noise between rows."""
    import json
    from pathlib import Path

    from tilefuse import _dispatch
    from tilefuse.ops.vq import configs

    path = Path(__file__).resolve().parents[1] / "bench/results/sweeps/vq-swiglu-h100-80gb-hbm3.json"
    times = {}
    for row in json.loads(path.read_text())["results"]:
        if row["N"]:
            times.setdefault((row["N"], row["K"], row["tokens"]), {})[row["impl"].split(":")[1]] = row["us"]
    fused_points = 0
    for (n, k, m), t in times.items():
        if configs.decide_swiglu(m, n, k, True, _dispatch.CHIPS["H100"], 132):
            fused_points += 1
            assert t["fused_forced"] <= 1.05 * t["two_vq"], (n, k, m, t)
        else:
            assert abs(t["fused"] - t["fused_forced"]) > 0.3, (n, k, m, "the sweep ran it fused")
            assert t["fused"] <= 1.05 * t["fused_forced"], (n, k, m, t)
    assert len(times) == 42 and fused_points == 27


def test_explain_says_fused_or_unfused_and_why(interpret):
    """``tilefuse.explain(tilefuse.vq_swiglu, ...)``: the path the op runs (its own plan) with both
    candidates' predictions; sizes the small kernel does not take have no fused prediction; the
    fp32 reference and no tokens are named; a forced variant is the source."""
    case = _Case(4, 128, 128, torch.float16, interpret)
    choice = tilefuse.explain(tilefuse.vq_swiglu, *case.args())
    assert choice.variant == "fused" == ("fused" if vq_op._plan_swiglu(*case.args()).fused else "unfused")
    times = {c.variant: c.predicted_us for c in choice.candidates}
    assert choice.source == "cost model" and 0 < times["fused"] < times["unfused"]
    assert "fused" in str(choice) and "two vq_matmul calls (small" in str(choice)
    odd = _Case(4, 40, 64, torch.float16, interpret)
    choice = tilefuse.explain("vq_swiglu", *odd.args())
    assert choice.variant == "unfused" and {c.variant: c.predicted_us for c in choice.candidates}["fused"] is None
    with tilefuse.force(variant="dequant"):
        forced = tilefuse.explain(tilefuse.vq_swiglu, *case.args())
    assert forced.variant == "unfused" and forced.source == "forced"
    assert tilefuse.explain(tilefuse.vq_swiglu, *case.args(case.x.float())).variant == "reference"
    assert tilefuse.explain(tilefuse.vq_swiglu, *case.args(case.x[:0])).variant == "empty"
