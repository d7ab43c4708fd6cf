"""Fused SwiGLU gate/up GEMM: kernels in the Triton interpreter (CPU), API, errors, and the GPU tests.

Interpreter runs use fp16 and fp32 (the interpreter computes bf16 ``tl.dot`` from raw bits) on
small shapes, including H and I that are not multiples of any tile.

Tolerances (against the fp64 spec):
* fp16 output: the kernels accumulate in fp32 (relative error ~H * 2^-24, far below fp16's ulp) and
  round once, so each element is within 0.5 ulp + that; ``rtol = 2^-10`` (1 fp16 ulp) with
  ``atol = 1e-4`` for results in fp16's subnormal range (ulp 2^-24 there). A wrong row, column,
  layout or a missing SiLU is off by O(1) and fails.
* fp32 output: fp32 arithmetic throughout; ``rtol = atol = 1e-5`` (~H * 2^-24 with H <= 200).
"""

import json

import pytest
import torch

import tilefuse
from tilefuse.ops.swiglu import configs, op
from tilefuse.ops.swiglu.op import pack_gate_up, run_kernel, unpack_gate_up
from tilefuse.testing import assert_close, frac_beyond_ulp, poisoned
from tilefuse.testing.swiglu import SHAPES as MODEL_SHAPES
from tilefuse.testing.swiglu import make_case, reference_fp64

TOL = {torch.float16: dict(atol=1e-4, rtol=2 ** -10), torch.float32: dict(atol=1e-5, rtol=1e-5)}

# (M, H, I): M = 1, 3, 37, 130; H and I not multiples of the tiles (BLOCK_K 32-128, BLOCK_N 16-64).
SHAPES = [(1, 72, 40), (3, 200, 136), (37, 136, 72), (130, 64, 56)]
SMALL_CFGS = [
    None,                                            # the op's own choice (heuristic)
    configs.SmallMConfig(16, 16, 32, split_k=3),     # split-K with an uneven K split
    configs.SmallMConfig(32, 32, 64, split_k=2, promote=False),  # tensor-core accumulation path
]
LARGE_CFGS = [configs.LargeMConfig(32, 32, 32, group_m=2, num_stages=2, num_warps=4, warp_specialize=False),
              configs.LargeMConfig(64, 16, 64, group_m=4, num_stages=2, num_warps=4, warp_specialize=False,
                                   promote=True)]


def _check(out, x, w, bias, dtype):
    ref = reference_fp64(x, w, bias)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cfg", SMALL_CFGS, ids=["auto", "split3", "split2"])
def test_small_m_kernel(interpret, shape, dtype, cfg):
    m, h, i = shape
    x, w, bias = make_case(m, h, i, dtype, interpret, bias=cfg is not None and cfg.split_k == 2)
    out = poisoned((m, i), dtype, interpret)
    run_kernel(x, w, bias, "merged", "small_m", cfg, out=out)
    _check(out, x, w, bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 72, 40), (37, 136, 72), (130, 64, 56)])
@pytest.mark.parametrize("cfg", LARGE_CFGS, ids=["32x32", "64x16"])
def test_large_m_kernel(interpret, shape, dtype, cfg):
    m, h, i = shape
    x, w, bias = make_case(m, h, i, dtype, interpret, bias=cfg.block_n == 16)
    out = poisoned((m, i), dtype, interpret)
    run_kernel(x, w, bias, "merged", "large_m", cfg, out=out)
    _check(out, x, w, bias, dtype)


def test_pingpong_pin_runs_large_m_off_hopper(interpret):
    """Where the Gluon kernel cannot run (the interpreter here), a "pingpong" pin runs the large-M
    kernel, through run_kernel and through the public op, packed layout included."""
    m, h, i = 37, 136, 128
    x, w, bias = make_case(m, h, i, torch.float16, interpret, bias=True)
    assert not op.pingpong_usable(x.device)
    out = poisoned((m, i), torch.float16, interpret)
    run_kernel(x, w, bias, "merged", "pingpong", configs.PingPongConfig(64, 32, 32, 2, 2), out=out)
    _check(out, x, w, bias, torch.float16)
    with tilefuse.force(variant="pingpong"):
        _check(tilefuse.swiglu(x, pack_gate_up(w[:i], w[i:]), bias, layout="packed"), x, w, bias, torch.float16)


SK_CFGS = [configs.LargeMConfig(32, 32, 32, 2, 2, 4, False, stream_k=1),
           configs.LargeMConfig(16, 16, 16, 4, 2, 4, False, stream_k=2)]


@pytest.mark.parametrize("num_sms,dtype", [(3, torch.float16), (7, torch.float16), (7, torch.float32),
                                           (132, torch.float16)], ids=["3", "7", "7-fp32", "132"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cfg", SK_CFGS, ids=["sk1", "sk2"])
def test_large_m_stream_k(interpret, shape, dtype, num_sms, cfg):
    """Stream-K tail: whole waves plus K runs that start and end inside tiles (3 and 7 programs),
    or every tile split over many programs (132); the tickets are re-armed for the second call."""
    m, h, i = shape
    x, w, bias = make_case(m, h, i, dtype, interpret, bias=num_sms == 7)
    sk_tiles, sk_iters = configs.stream_k_split(m, h, i, cfg, num_sms)
    tiles = -(-m // cfg.block_m) * -(-i // cfg.block_n)
    assert sk_tiles == (0 if tiles % num_sms == 0 else min(tiles, tiles % num_sms + (cfg.stream_k - 1) * num_sms))
    for _ in range(2 if num_sms == 7 else 1):
        out = poisoned((m, i), dtype, interpret)
        run_kernel(x, w, bias, "merged", "large_m", cfg, out=out, num_sms=num_sms)
        _check(out, x, w, bias, dtype)
    packed = pack_gate_up(w[:i], w[i:]) if i % 64 == 0 else None
    if packed is not None and cfg.block_n == 64:
        out = poisoned((m, i), dtype, interpret)
        run_kernel(x, packed, bias, "packed", "large_m", cfg, out=out, num_sms=num_sms)
        _check(out, x, w, bias, dtype)


def test_config_overrides(tmp_path, monkeypatch):
    """The "swiglu" section of a TILEFUSE_CONFIGS file replaces table entries."""
    from tilefuse import _env

    monkeypatch.setattr(configs, "TUNED", {k: dict(v) for k, v in configs.TUNED.items()})
    cfg = configs.LargeMConfig(128, 64, 64, 8, 4, 4, False, stream_k=2)
    pingpong = configs.PingPongConfig(64, 128, 64, 4, 3)
    (tmp_path / "w.json").write_text(json.dumps(
        {"swiglu": [{"H": 896, "I": 4864, "M": 128, "variant": "large_m", "config": dict(cfg.__dict__)},
                    {"H": 896, "I": 4864, "M": 4096, "variant": "pingpong", "config": dict(pingpong.__dict__)}]}))
    monkeypatch.setenv("TILEFUSE_CONFIGS", str(tmp_path / "w.json"))
    try:
        configs.apply_overrides(_env.reload().configs["swiglu"])
        assert configs.choose(100, 896, 4864) == ("large_m", cfg)
        assert configs.choose(3000, 896, 4864) == ("pingpong", pingpong)
    finally:
        monkeypatch.delenv("TILEFUSE_CONFIGS")
        _env.reload()
        configs.decide.cache_clear()


def test_table_entries_serve_only_where_the_measurement_transfers():
    # 0.5B: the M = 64 small-M entry (64-row tiles) serves M = 17..64 (one row tile, fewer rows);
    # the M = 128 large-M entry (128-row tiles) serves M = 65..128, decided once for the range
    assert configs.choose(32, 896, 4864) == ("small_m", configs.TUNED[(896, 4864)][64])
    assert configs.decision(65, 896, 4864) is configs.decision(128, 896, 4864)
    assert configs.choose(100, 896, 4864) == ("large_m", configs.TUNED[(896, 4864)][128])
    # without an M = 64 entry, 17..64 rows run in the 128-row tiles of the M = 128 entry: one tile too
    table = {(5120, 13824): {16: configs.TUNED[(5120, 13824)][16], 128: configs.TUNED[(5120, 13824)][128]}}
    assert configs._measured(table, 5120, 13824, 40) == configs.TUNED[(5120, 13824)][128]
    # between 128 and 1024 rows the tile counts and waves differ from both measurements: the cost
    # model decides, per 128 rows (DeepSeek-V3's expert: unfused at 128, large-M at 1024 measured)
    choice = configs.decision(333, 7168, 2048)
    assert choice.source == "cost model" and choice.problem["M"] == "257..384"
    # two waves of tiles at the range's low end: the measurement at its top transfers
    assert configs.decision(3000, 896, 4864).source.startswith("shipped")
    # past the last measured M the last entry serves
    assert configs.choose(50000, 896, 4864) == ("large_m", configs.TUNED[(896, 4864)][16384])


def test_stream_k_split_and_wave_efficiency():
    # 7B at M = 128: 148 tiles of 128 x 128 on 132 SMs; 16 tail tiles * 56 K steps over 132 SMs.
    cfg = configs.LargeMConfig(128, 128, 64, stream_k=1)
    assert configs.stream_k_split(128, 3584, 18944, cfg, 132) == (16, 7)
    assert configs.stream_k_split(128, 3584, 18944, configs.LargeMConfig(), 132) == (0, 0)
    assert configs.wave_efficiency(128, 3584, 18944, configs.LargeMConfig()) == pytest.approx(148 / 264)
    assert configs.wave_efficiency(128, 3584, 18944, cfg) == pytest.approx(148 * 56 / ((56 + 7) * 132))
    # fewer tiles than SMs: all of them are stream-K (1.5B at M = 128: 70 tiles, 24 K steps)
    assert configs.stream_k_split(128, 1536, 8960, cfg, 132) == (70, 13)


@pytest.mark.parametrize("variant,cfg", [
    ("small_m", configs.SmallMConfig(16, 32, 32, split_k=2)),
    ("small_m", configs.SmallMConfig(16, 64, 64)),
    ("large_m", configs.LargeMConfig(32, 64, 32, 2, 2, 4, False)),
    ("large_m", configs.LargeMConfig(32, 128, 32, 2, 2, 4, False)),
], ids=["small-split2", "small-64", "large-64", "large-128"])
@pytest.mark.parametrize("m", [3, 37])
def test_packed_layout(interpret, variant, cfg, m):
    h, i = 88, 192  # 3 packed blocks: a BLOCK_N = 128 tile straddles the end of I
    x, w, bias = make_case(m, h, i, torch.float16, interpret, bias=True)
    packed = pack_gate_up(w[:i], w[i:])
    out = poisoned((m, i), torch.float16, interpret)
    run_kernel(x, packed, bias, "packed", variant, cfg, out=out)
    _check(out, x, w, bias, torch.float16)


def test_pack_roundtrip_and_layout():
    w_gate, w_up = torch.randn(128, 16), torch.randn(128, 16)
    packed = pack_gate_up(w_gate, w_up)
    assert packed.shape == (256, 16) and packed.is_contiguous()
    assert torch.equal(packed[64:128], w_up[:64]) and torch.equal(packed[128:192], w_gate[64:])
    g, u = unpack_gate_up(packed)
    assert torch.equal(g, w_gate) and torch.equal(u, w_up)


@pytest.mark.parametrize("layout", ["merged", "packed"])
def test_public_op_dispatch(interpret, layout):
    """The public op on a 3-D input, through dispatch (small M) and a forced large-M run."""
    x, w, bias = make_case(0, 64, 128, torch.float16, interpret, bias=True, lead=(2, 3))
    wk = w if layout == "merged" else pack_gate_up(w[:128], w[128:])
    ref = reference_fp64(x, w, bias)
    assert_close(tilefuse.swiglu(x, wk, bias, layout=layout), ref, **TOL[torch.float16])
    with tilefuse.force(variant="large_m"):
        assert_close(tilefuse.swiglu(x, wk, bias, layout=layout), ref, **TOL[torch.float16])


def test_reference_backend_and_accuracy_measure():
    """Reference path (bf16 on CPU): packed equals merged; one rounding stays within 1 ulp."""
    x, w, _ = make_case(5, 64, 128, torch.bfloat16, "cpu")
    with tilefuse.force(backend="reference"):
        merged = tilefuse.swiglu(x, w)
        packed = tilefuse.swiglu(x, pack_gate_up(w[:128], w[128:]), layout="packed")
    assert torch.equal(merged, packed)
    assert frac_beyond_ulp(merged, reference_fp64(x, w)) == 0.0
    # The unfused recipe rounds gate, up and silu(gate) to bf16: the measure must see that.
    g, u = (x @ w[:128].T), (x @ w[128:].T)
    unfused = torch.nn.functional.silu(g) * u
    assert frac_beyond_ulp(unfused, reference_fp64(x, w)) > 0.01


def test_empty_batch(interpret):
    x, w, _ = make_case(0, 64, 64, torch.float16, interpret, lead=(0,))
    assert tilefuse.swiglu(x, w).shape == (0, 64)


def test_config_choice_is_cached_and_covers_m():
    for m in (1, 16, 100, 256, 257, 5000):
        variant, cfg = configs.choose(m, 896, 4864)
        assert variant == ("unfused" if cfg is None else configs.variant_of(cfg))
        assert configs.choose(m, 896, 4864) == (variant, cfg)
    assert configs.choose(1, 896, 4864, variant="large_m")[0] == "large_m"
    assert configs.choose(9000, 896, 4864, variant="small_m")[0] == "small_m"
    assert configs.choose(4096, 896, 4864, variant="pingpong") == configs.choose(4096, 896, 4864)  # the table's
    assert configs.choose(9000, 896, 4864, variant="pingpong") == ("pingpong", configs.PingPongConfig())


@pytest.mark.parametrize("call,match", [
    (lambda x, w: tilefuse.swiglu(x.int(), w.int()), "x: expected dtype"),
    (lambda x, w: tilefuse.swiglu(x, w.half()), "w_gate_up: expected dtype bfloat16"),
    (lambda x, w: tilefuse.swiglu(x, w[:, :32]), r"w_gate_up: expected shape \[2I, H=64\]"),
    (lambda x, w: tilefuse.swiglu(x[:, :60], w[:, :60].contiguous()), "x: expected H"),
    (lambda x, w: tilefuse.swiglu(x, w[:120]), "w_gate_up: expected 2I"),
    (lambda x, w: tilefuse.swiglu(x, w.t().contiguous().t()), "w_gate_up: expected a contiguous"),
    (lambda x, w: tilefuse.swiglu(x, w, layout="interleaved"), "layout: expected one of"),
    (lambda x, w: tilefuse.swiglu(x, w[:64], layout="packed"), "layout='packed'"),
    (lambda x, w: tilefuse.swiglu(x, w, torch.zeros(7, dtype=x.dtype)), r"bias: expected shape \[2I=128\]"),
    (lambda x, w: tilefuse.swiglu(x, w, torch.zeros(128)), "bias: expected dtype"),
    (lambda x, w: tilefuse.swiglu("x", w), "x: expected a torch.Tensor"),
    (lambda x, w: pack_gate_up(w[:40], w[40:80]), "w_gate: expected I"),
    (lambda x, w: pack_gate_up(w[:64], w[64:96]), "w_up: expected shape"),
])
def test_errors_name_the_argument(call, match):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        call(x, w)


# ---------------------------------------------------------------- gradients, dtypes, sizes
@pytest.mark.parametrize("layout", ["merged", "packed"])
def test_gradcheck(layout):
    """The registered backward against finite differences (fp64: the reference path)."""
    inter = 64 if layout == "packed" else 12      # packed: I a multiple of 64
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = 0.3 * torch.randn(2 * inter, 8, dtype=torch.float64)
    if layout == "packed":
        w = pack_gate_up(w[:inter], w[inter:])
    w.requires_grad_()
    b = torch.randn(2 * inter, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: tilefuse.swiglu(x, w, b, layout=layout), (x, w, b),
                                    fast_mode=True)


def test_kernel_path_gradients_match_reference(interpret):
    """fp16 through the kernel (forward) + the registered backward == autograd of the fp32 spec."""
    x, w, bias = make_case(4, 64, 64, torch.float16, interpret, bias=True)
    x.requires_grad_(), w.requires_grad_(), bias.requires_grad_()
    y = tilefuse.swiglu(x, w, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, bias))
    from tilefuse.ops.swiglu.reference import swiglu_reference
    swiglu_reference(xr, wr, br).backward(dy.float())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (bias.grad, br.grad)):
        assert got.dtype == torch.float16
        assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_compile_in_grad_mode():
    """torch.compile of a training step traces the op and its backward (CPU: aot_eager)."""
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    loss = torch.compile(lambda x, w: tilefuse.swiglu(x, w).sum(), fullgraph=True, backend="aot_eager")(x, w)
    loss.backward()
    assert x.grad is not None and w.grad is not None


def _fresh_compile_state():
    """As in a fresh process: no cached call plan (a cached plan from an eager call kept tracing
    out of the planning code) and no compiled graphs."""
    op._plans.clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compile_before_any_eager_call(backend, dynamic, request):
    """torch.compile(fullgraph=True) of the first call in the process: tracing once went through
    the plan, the cost model and the tuned table's file lookup (posix.stat: a graph break);
    ``triton``: the kernels in the interpreter (CPU), ``reference``: PyTorch. Then a second M."""
    device = request.getfixturevalue("interpret") if backend == "triton" else torch.device("cpu")
    _fresh_compile_state()
    x, w, bias = make_case(3, 64, 40, torch.float16, device, bias=True)
    with tilefuse.force(backend=backend):
        fn = torch.compile(lambda x, w, b: tilefuse.swiglu(x, w, b), fullgraph=True, backend="aot_eager",
                           dynamic=dynamic)
        out = fn(x, w, bias)
        _check(out, x, w, bias, torch.float16)
        x5 = torch.randn(5, 64, dtype=torch.float16, device=device)
        _check(fn(x5, w, bias), x5, w, bias, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("m", [1, 4, 512])
def test_compile_before_any_eager_call_on_gpu(m, dynamic):
    """Inductor, fullgraph, compiled in a fresh state: the same output as the eager call (the same
    kernel or unfused path runs inside the compiled graph)."""
    _fresh_compile_state()
    x, w, _ = make_case(m, 4096, 1024, torch.bfloat16, "cuda")
    out = torch.compile(lambda x, w: tilefuse.swiglu(x, w), fullgraph=True, dynamic=dynamic)(x, w)
    torch.testing.assert_close(out, tilefuse.swiglu(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_fp64_run_the_reference(dtype):
    x, w, bias = make_case(5, 40, 24, dtype, "cpu", bias=True)
    out = tilefuse.swiglu(x, w, bias)
    assert out.dtype == dtype
    assert_close(out, reference_fp64(x, w, bias), atol=1e-5, rtol=1e-5)


def test_zero_sizes(interpret):
    """H = 0 (silu(bg) * bu), I = 0 and M = 0 on the kernel path: no launch, right shapes."""
    x = torch.randn(3, 0, dtype=torch.float16, device=interpret)
    w = torch.zeros(16, 0, dtype=torch.float16, device=interpret)
    b = torch.randn(16, dtype=torch.float16, device=interpret)
    out = tilefuse.swiglu(x, w, b)
    expect = torch.nn.functional.silu(b[:8].float()) * b[8:].float()
    assert_close(out, expect.expand(3, 8), atol=1e-3, rtol=1e-3)
    assert tilefuse.swiglu(torch.randn(3, 8, dtype=torch.float16, device=interpret),
                           torch.zeros(0, 8, dtype=torch.float16, device=interpret)).shape == (3, 0)


# ---------------------------------------------------------------- GPU (H200)
# Bench shapes, bf16 and fp16, both schedules forced and dispatched.
#
# Tolerances, against the fp64 reference:
# * elementwise: 1 ulp relative (``rtol = 2^-7`` bf16, ``2^-10`` fp16) plus ``atol = 1e-3`` for outputs
#   near zero; one rounding after fp32 accumulation is within 0.5 ulp + ~1e-5 absolute for H <= 8192.
#   A wrong row/column/layout/SiLU is off by O(1).
# * fraction of outputs beyond 1 ulp (the paper's measure): an output whose gate or up projection
#   lies within ~500x the accumulation error of zero can round to the neighbouring value. Exact fp32
#   (CPU) gives ~1e-5..3e-5 (bf16); the H200's tensor cores accumulate fp32 with truncation, and the
#   first H200 run measured 1e-4 (H = 896) growing with H to 1.1e-3 (H = 8192) for bf16, ~6e-3 for
#   fp16 (finer ulp). Bounds: 2e-3 (bf16), 1.5e-2 (fp16), plus 3 elements for small samples; the
#   unfused recipe sits at ~10 %, a wrong kernel near 100 %. With per-K-step promotion (opt-in
#   ``promote=True``) the bound is the project's goal, 1e-4 (met on the H200). The benchmark reports the fractions.
# The reference is computed in fp64 on a sample of rows (first, last and random ones); every output
# element is checked to be written (the buffer is poisoned with NaN).


GPU_RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
GPU_FRAC = {torch.bfloat16: 2e-3, torch.float16: 1.5e-2}


def _sample_rows(m):
    if m <= 384:
        return torch.arange(m)
    return torch.cat((torch.arange(128), torch.randint(128, m - 128, (128,)), torch.arange(m - 128, m)))


def _check_gpu(out, x, w, bias, frac_bound=None):
    assert torch.isfinite(out).all(), "unwritten (NaN) or overflowed outputs"
    rows = _sample_rows(x.shape[0]).to(x.device)
    ref = reference_fp64(x[rows], w, bias)
    n = ref.numel()
    frac = frac_beyond_ulp(out[rows], ref)
    bound = GPU_FRAC[out.dtype] if frac_bound is None else frac_bound
    assert frac <= bound + 3 / n, f"{frac:.2e} of {n} outputs beyond 1 ulp"
    assert_close(out[rows], ref, atol=1e-3, rtol=GPU_RTOL[out.dtype])


MODELS_BF16 = list(MODEL_SHAPES)
MODELS_FP16 = ["0.5B", "14B", "72B"]
GPU_CASES = ([(mdl, torch.bfloat16) for mdl in MODELS_BF16] + [(mdl, torch.float16) for mdl in MODELS_FP16])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["small_m", "large_m", "pingpong", None],
                         ids=["small_m", "large_m", "pingpong", "dispatch"])
@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize("model,dtype", GPU_CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in GPU_CASES])
def test_bench_shapes(model, dtype, m, variant):
    """Every kernel pinned, and the dispatch. Where the dispatch runs the unfused path (cuBLAS's
    GEMM rounds gate and up to the dtype before SiLU, as the two-GEMM code it stands for: ~5-10 %
    of the outputs beyond 1 ulp of the fp64 reference), its output is checked against that recipe
    in PyTorch instead: within 1 ulp of it, which a wrong layout or SiLU would not be."""
    h, i = MODEL_SHAPES[model]
    x, w, _ = make_case(m, h, i, dtype, "cuda")
    out = poisoned((m, i), dtype, "cuda")
    run_kernel(x, w, None, "merged", variant, out=out)
    if variant is None and op.plan(m, h, i, x.device, None)[0] == "unfused":
        assert torch.isfinite(out).all(), "unwritten (NaN) or overflowed outputs"
        y = torch.nn.functional.linear(x, w).float()
        recipe = (torch.nn.functional.silu(y[:, :i]) * y[:, i:]).to(dtype)
        assert_close(out, recipe, atol=1e-3, rtol=GPU_RTOL[dtype])
        return
    _check_gpu(out, x, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["small_m", "large_m", "pingpong"])
@pytest.mark.parametrize("m", [1, 37, 300, 2051])
def test_packed_and_bias_odd_m(variant, m):
    h, i = MODEL_SHAPES["1.5B"]
    x, w, bias = make_case(m, h, i, torch.bfloat16, "cuda", bias=True)
    with tilefuse.force(variant=variant):
        merged = tilefuse.swiglu(x, w, bias)
        packed = tilefuse.swiglu(x, pack_gate_up(w[:i], w[i:]), bias, layout="packed")
    _check_gpu(merged, x, w, bias)
    _check_gpu(packed, x, w, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_split_k_fixup_repeated(split_k):
    """Split-K tickets are re-armed: many back-to-back launches stay exact and identical."""
    h, i = MODEL_SHAPES["7B"]
    x, w, _ = make_case(16, h, i, torch.bfloat16, "cuda")
    cfg = configs.SmallMConfig(16, 32, 128, split_k=split_k)
    first = run_kernel(x, w, None, config=cfg)
    _check_gpu(first, x, w, None)
    for _ in range(20):
        again = run_kernel(x, w, None, config=cfg)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [configs.LargeMConfig(), configs.LargeMConfig(128, 64, 64, 8, 4, 4, False),
                                 configs.LargeMConfig(64, 128, 64, 8, 4, 4, False)], ids=["ws", "128x64", "64x128"])
@pytest.mark.gpu
def test_large_m_configs_odd_shape(cfg):
    x, w, _ = make_case(1000, 1032, 1000, torch.float16, "cuda")  # nothing divides the tiles
    _check_gpu(run_kernel(x, w, None, config=cfg), x, w, None)


@pytest.mark.parametrize("cfg", [configs.LargeMConfig(128, 128, 64, 8, 4, 8, False, stream_k=1),
                                 configs.LargeMConfig(128, 64, 64, 8, 4, 4, False, stream_k=2)], ids=["sk1", "sk2"])
@pytest.mark.parametrize("model,m", [("0.5B", 128), ("1.5B", 128), ("7B", 128), ("0.5B", 1024), ("3B", 1024),
                                     ("72B", 37)])
@pytest.mark.gpu
def test_stream_k_tail(model, m, cfg):
    """Stream-K tail on bench shapes: exact, every output written, bit-identical over repeated
    launches and CUDA-graph replays (the tickets are re-armed, the fix-up order is fixed)."""
    h, i = MODEL_SHAPES[model]
    x, w, bias = make_case(m, h, i, torch.bfloat16, "cuda", bias=model == "1.5B")
    out = poisoned((m, i), torch.bfloat16, "cuda")
    first = run_kernel(x, w, bias, config=cfg, out=out).clone()
    _check_gpu(first, x, w, bias)
    for _ in range(5):
        torch.testing.assert_close(run_kernel(x, w, bias, config=cfg), first, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run_kernel(x, w, bias, config=cfg)
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(replayed, first, rtol=0, atol=0)


@pytest.mark.gpu
def test_unaligned_and_strided_inputs():
    h, i = 896, 4864
    x, w, _ = make_case(130, h + 8, i, torch.bfloat16, "cuda")
    w = w[:, :h].contiguous()
    strided = x[:, 8:]  # row stride H + 8 (16-byte multiple), offset 16 bytes: TMA-able as is
    flat = torch.randn(130 * h + 4, device="cuda").to(torch.bfloat16)
    unaligned = flat[4:].view(130, h)  # base 8 bytes off a 16-byte boundary: not TMA-able
    assert unaligned.data_ptr() % 16 == 8
    for variant in ("small_m", "large_m", "pingpong"):
        with tilefuse.force(variant=variant):
            _check_gpu(tilefuse.swiglu(strided, w), strided, w, None)
            _check_gpu(tilefuse.swiglu(unaligned, w), unaligned, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["7B", "72B"])
def test_promoted_accumulation_meets_accuracy_target(model):
    """Small-M kernel with promote=True: <= 0.01 % of bf16 outputs beyond 1 ulp (the accuracy goal).

    The first H200 run failed this (4.4e-4 at 7B, 1.0e-3 at 72B) because Triton had folded the
    promotion away; the run-time-zero version passed on the H200 (2026-11-29 tail runs, as xfail).
    """
    h, i = MODEL_SHAPES[model]
    x, w, _ = make_case(16, h, i, torch.bfloat16, "cuda")
    out = run_kernel(x, w, None, config=configs.SmallMConfig(16, 64, 256, 1, 3, promote=True))
    _check_gpu(out, x, w, None, frac_bound=1e-4)


def test_gluon_and_tl_tile_orders_agree():
    """The Gluon kernels' grouped tile order (``gluon_common``) is ``tl_common``'s, and each is a
    permutation of the tiles (checked by running both functions' Python bodies on integers)."""
    import types

    pytest.importorskip("triton.experimental.gluon")
    from tilefuse.ops import gluon_common, tl_common

    def plain(jitted, module_name):
        fn = jitted.fn
        return types.FunctionType(fn.__code__, {**fn.__globals__, module_name: types.SimpleNamespace(minimum=min)})

    tl_order, gluon_order = plain(tl_common.grouped_tile, "tl"), plain(gluon_common.grouped_tile, "gl")
    for num_m, num_n, group in [(1, 7, 8), (5, 3, 2), (9, 4, 8), (17, 11, 4)]:
        tiles = [tl_order(t, num_m, num_n, group) for t in range(num_m * num_n)]
        assert tiles == [gluon_order(t, num_m, num_n, group) for t in range(num_m * num_n)]
        assert sorted(tiles) == [(m, n) for m in range(num_m) for n in range(num_n)]


# ----------------------------------------------------------------------------- dispatch with the baseline
def _unfused_spec(x, w, bias, wk, layout):
    """What the unfused path computes: PyTorch's GEMM ``y = x wk^T`` in x's dtype -- the call the
    path makes, on the same operands, so the same rounding whatever the CPU -- with its columns put
    back in merged order, then the bias and SiLU * mul exactly (fp64). The path adds fp32 arithmetic
    and one final rounding, so it is within 1 ulp of this (``TOL``).

    The GEMM's own rounding is not assumed: PyTorch's fp16 CPU GEMM is not correctly rounded on
    every CPU (with AVX512-FP16, 10 of 14208 elements of y were 1 ulp off the rounded fp64
    product), and SiLU * mul amplifies 1 ulp of g by ~(1 + |g|)/2. Instead ``y`` itself is checked
    against the fp64 product with a bound that holds for any summation order and any accumulation
    precision down to fp16 (unit roundoff u = 2^-11): |y - x w^T| <= (K + 1) u sum_k |x_k w_k| (the
    products, K - 1 additions and the final rounding each add at most u of the running sum) plus
    K subnormal steps. A wrong operand, row or column is off by O(|y|), ~sqrt(K) times more."""
    y = torch.nn.functional.linear(x, wk)
    if layout == "packed":      # packed columns -> [gate | up]
        gate, up = unpack_gate_up(y.T)
        y = torch.cat((gate, up)).T
    k = x.shape[-1]
    exact, terms = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert ((y.double() - exact).abs() <= (k + 1) * 2.0 ** -11 * terms + k * 2.0 ** -24).all(), "the GEMM itself"
    y = y.double() + (0 if bias is None else bias.double())
    inter = w.shape[0] // 2
    return torch.nn.functional.silu(y[..., :inter]) * y[..., inter:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["merged", "packed"])
@pytest.mark.parametrize("m", [1, 3, 37])
def test_unfused_path(interpret, m, layout, dtype):
    """The baseline candidate (cuBLAS GEMM + the SiLU*mul pass), forced, on both layouts."""
    h, i = 72, 192
    x, w, bias = make_case(m, h, i, dtype, interpret, bias=True)
    wk = w if layout == "merged" else pack_gate_up(w[:i], w[i:])
    spec = _unfused_spec(x, w, bias, wk, layout)
    with tilefuse.force(variant="unfused"):
        out = tilefuse.swiglu(x, wk, bias, layout=layout)
    assert_close(out, spec, **TOL[dtype])
    out = poisoned((m, i), dtype, interpret)
    run_kernel(x, wk, bias, layout, "unfused", out=out)
    assert_close(out, spec, **TOL[dtype])


def test_unfused_gemm_gets_its_own_cublas_workspace_while_capturing(interpret, monkeypatch):
    """While a CUDA graph captures, the unfused path's cuBLAS GEMM runs between two drops of
    PyTorch's cached cuBLAS workspaces (``_scratch.blas``), so it allocates one from the graph's
    pool and no other graph reuses it (graphs captured on one stream shared one and raced when
    replayed at once; the GPU test is in test_concurrency.py). Simulated: the capture status and
    the drop are stubs on a CPU."""
    from tilefuse import _scratch

    events = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: events.append("gemm") or linear(*a))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("drop"), raising=False)
    x, w, _ = make_case(3, 64, 32, torch.float16, interpret)
    with tilefuse.force(variant="unfused"):
        tilefuse.swiglu(x, w)
        assert events == ["gemm"]                            # eager: nothing dropped
        events.clear()
        monkeypatch.setattr(_scratch, "_capturing", lambda args: True)
        tilefuse.swiglu(x, w)
    assert events == ["drop", "gemm", "drop"]
    events.clear()
    with pytest.raises(ZeroDivisionError):                   # dropped again when the call fails
        _scratch.blas(lambda t: events.append("gemm") or 1 / 0, x)
    assert events == ["drop", "gemm", "drop"]


def test_cost_model_keeps_the_baseline_where_the_kernels_lost():
    """DeepSeek-V3's routed expert (H 7168, I 2048) was measured slower fused than unfused on the
    H200 at M = 48 and 333 (bench/results/sweeps/swiglu-tune-h200.json has M = 64 and 128 in the
    unfused path's favour); between two measured M whose winners differ (128: unfused, 1024: the
    large-M kernel) the cost model decides, and keeps the baseline at 333. Where the shipped
    table has a measured entry, it rules."""
    for m in (48, 128, 333):
        assert configs.choose(m, 7168, 2048)[0] == "unfused", m
    assert configs.decide(333, 7168, 2048).source == "cost model"
    assert configs.choose(1, 7168, 2048) == ("small_m", configs.TUNED[(7168, 2048)][1])
    assert configs.choose(1, 896, 4864) == ("small_m", configs.TUNED[(896, 4864)][1])
    assert configs.decide(1, 896, 4864).source.startswith("shipped table")
    # a table entry may name the baseline itself
    assert configs.TUNED[(7168, 2048)][64] == configs.U and configs.choose(64, 7168, 2048) == ("unfused", None)
    # and the cost model does pick a kernel where it predicts one clearly faster in a measured
    # regime: long M on a large layer off the table (the large-M kernel measured at 0.84-0.99x
    # the unfused path from M = 4096 on the calibration shapes)
    assert (4096, 12288) not in configs.TUNED and configs.choose(4096, 4096, 12288)[0] == "large_m"


def test_cost_model_is_deterministic_cached_and_monotone():
    configs.decide.cache_clear()
    first = configs.decide(7, 5120, 1536)
    assert configs.decide(7, 5120, 1536) is first and configs.decide.cache_info().hits == 1
    chip = tilefuse._dispatch.CHIPS["H200"]
    for variant, cfg in configs.candidates(7, 5120, 1536, 132):
        times = [configs.predict_us(variant, cfg, m, 5120, 1536, chip) for m in (1, 16, 256, 4096)]
        assert all(t > 0 for t in times) and times == sorted(times), (variant, times)
    # sizes above 64 share one decision per power of two; the plan lookup stays one dict hit
    assert configs.choose(100, 5120, 1536) == configs.choose(128, 5120, 1536)


def test_explain_names_the_path_and_its_candidates(interpret):
    x, w, _ = make_case(5, 64, 128, torch.float16, interpret)
    choice = tilefuse.explain(tilefuse.swiglu, x, w)
    assert choice.variant in ("small_m", "large_m", "unfused") and choice.source == "cost model"
    assert {c.variant for c in choice.candidates} >= {"small_m", "unfused"}
    assert all(c.predicted_us > 0 for c in choice.candidates)
    assert choice.variant in str(choice) and "us" in str(choice)
    with tilefuse.force(variant="unfused"):
        forced = tilefuse.explain("swiglu", x, w)
    assert (forced.variant, forced.source) == ("unfused", "forced")
    assert tilefuse.explain(tilefuse.swiglu, x.float(), w.float()).variant == "reference"
    with pytest.raises(ValueError, match="op: expected one of"):
        tilefuse.explain("no_such_op", x)
