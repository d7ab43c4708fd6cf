"""tilefuse.nn.VQLinear: AQLM state-dict compatibility, safetensors round trip, from_linear."""

import pytest
import torch
from torch import nn

import tilefuse
from tilefuse.nn import VQLinear
from tilefuse.ops.vq.reference import dequantize
from tilefuse.testing.vq import make_weight


def _aqlm_state_dict(n, k, bias=True):
    """A state dict laid out as an AQLM 2x8 QuantizedLinear (int8 codes, fp16 books/scales)."""
    codes, books, scales = make_weight(n, k, torch.float16, "cpu", codes_dtype=torch.int8)
    sd = {"codes": codes, "codebooks": books, "scales": scales}
    if bias:
        sd["bias"] = torch.randn(n).half()
    return sd


def test_loads_aqlm_state_dict_and_matches_reference(interpret):
    sd = _aqlm_state_dict(24, 64)
    layer = VQLinear(64, 24, bias=True)
    layer.load_state_dict(sd)  # strict: same names, shapes, dtypes as AQLM's
    assert set(layer.state_dict()) == {"codes", "codebooks", "scales", "bias"}
    layer = layer.to(interpret)
    x = torch.randn(3, 64).half().to(interpret)
    y = layer(x)
    w = dequantize(sd["codes"], sd["codebooks"].double(), sd["scales"].double(), dtype=torch.float64)
    ref = x.double().cpu() @ w.T + sd["bias"].double()
    scale = (x.double().cpu().abs() @ w.abs().T)
    assert ((y.double().cpu() - ref).abs() <= 2 ** -10 * ref.abs() + 2 ** -14 * scale).all()


def test_safetensors_round_trip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    layer = VQLinear(64, 16, bias=False, codes_dtype=torch.int8)
    layer.load_state_dict(_aqlm_state_dict(16, 64, bias=False))
    path = tmp_path / "vq.safetensors"
    st.save_file(layer.state_dict(), str(path))
    loaded = st.load_file(str(path))
    again = VQLinear(64, 16, bias=False)
    again.load_state_dict(loaded)
    for name, t in layer.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]) and t.dtype == again.state_dict()[name].dtype


def test_uint8_layer_loads_int8_codes():
    sd = _aqlm_state_dict(8, 64, bias=False)
    layer = VQLinear(64, 8, bias=False, codes_dtype=torch.uint8)
    layer.load_quantized(sd["codes"], sd["codebooks"], sd["scales"])
    assert torch.equal(layer.codes.view(torch.int8), sd["codes"])
    assert torch.equal(layer.dequantize(), dequantize(sd["codes"], sd["codebooks"], sd["scales"]))


def test_from_linear_quantizes(interpret):
    pytest.importorskip("tilefuse.quantizer")
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True, dtype=torch.float16)
    layer = VQLinear.from_linear(linear, iters=1, beam=1, init_iters=2, progress=False, device="cpu")
    assert layer.codes.shape == (32, 8, 2) and layer.codes.dtype == torch.int8
    w_hat = layer.dequantize().float()
    rel = (w_hat - linear.weight.float()).norm() / linear.weight.float().norm()
    assert rel < 0.6, rel  # 2 bits/weight on a random (incompressible) matrix: coarse, yet not noise
    x = torch.randn(2, 64).half()
    with tilefuse.force(backend="reference"):
        y = layer(x)
    expect = x.double() @ w_hat.double().T + linear.bias.double()
    assert torch.allclose(y.double(), expect, rtol=2 ** -9, atol=1e-3)


def test_from_linear_shows_progress_by_default(capsys):
    """Quantizing a layer takes minutes at real sizes: the quantizer's line per stage by default,
    nothing with progress=False."""
    linear = nn.Linear(64, 32, bias=False)
    VQLinear.from_linear(linear, iters=1, beam=1, init_iters=2, device="cpu")
    err = capsys.readouterr().err
    assert err.count("tilefuse.quantize [32x64]") == 2          # the init and the one pass
    VQLinear.from_linear(linear, iters=1, beam=1, init_iters=2, device="cpu", progress=False)
    assert capsys.readouterr().err == ""


def test_constructor_errors():
    with pytest.raises(ValueError, match="in_features"):
        VQLinear(60, 8)
    with pytest.raises(ValueError, match="codes_dtype"):
        VQLinear(64, 8, codes_dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        VQLinear(64, 8, dtype=torch.int32)
    layer = VQLinear(64, 8)
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(1, 64).int())  # integer input
    with pytest.raises(ValueError, match=r"codes: expected values in \[0, 256\)"):
        layer.load_quantized(torch.full((8, 8, 2), 300), layer.codebooks, layer.scales)
    with pytest.raises(ValueError, match="codes: expected shape"):
        layer.load_quantized(torch.zeros(8, 4, 2, dtype=torch.uint8), layer.codebooks, layer.scales)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("codes_dtype", [torch.int8, torch.uint8])
def test_load_state_dict_refuses_codes_it_would_narrow(codes_dtype, strict):
    """int32 code 300 would become 44 and float code 3.7 would become 3 in the int8/uint8 buffer:
    load_state_dict refuses them as load_quantized does, naming the key; wide integer codes in
    range and the other 1-byte dtype load with their code values."""
    sd = _aqlm_state_dict(8, 64, bias=False)
    layer = VQLinear(64, 8, bias=False, codes_dtype=codes_dtype)
    before = layer.codes.clone()
    wide = sd["codes"].view(torch.uint8).to(torch.int32)
    for bad, match in ((wide.clone().fill_(300), r"state_dict\['codes'\]: expected values in \[0, 256\)"),
                       (wide.clone().fill_(-1), r"state_dict\['codes'\]: expected values in \[0, 256\)"),
                       (wide.float() + 0.7, r"state_dict\['codes'\]: expected integer codes"),
                       (wide > 3, r"state_dict\['codes'\]: expected integer codes")):
        with pytest.raises(ValueError, match=match):
            layer.load_state_dict({**sd, "codes": bad}, strict=strict)
        assert torch.equal(layer.codes, before)
    for good in (wide, wide.long(), sd["codes"], sd["codes"].view(torch.uint8)):
        layer.load_state_dict({**sd, "codes": good}, strict=strict)
        assert layer.codes.dtype == codes_dtype
        assert torch.equal(layer.codes.view(torch.uint8), sd["codes"].view(torch.uint8))
    # nested in a model, the key carries the module's prefix
    model = nn.Sequential(VQLinear(64, 8, bias=False))
    with pytest.raises(ValueError, match=r"state_dict\['0.codes'\]"):
        model.load_state_dict({f"0.{k}": v for k, v in {**sd, "codes": wide.float()}.items()}, strict=strict)
    # assign=True keeps the module's codes dtype
    layer.load_state_dict({**sd, "codes": wide}, assign=True)
    assert layer.codes.dtype == codes_dtype
    with pytest.raises(ValueError, match="codes: expected integer codes"):
        layer.load_quantized(wide.float(), sd["codebooks"], sd["scales"])


def test_fp32_layer_and_inputs_run_the_reference():
    """fp32 (a default nn.Linear, quantize's codebooks): accepted, computed by the reference."""
    codes, books, scales = make_weight(16, 64, torch.float32, "cpu")
    layer = VQLinear(64, 16, bias=False, dtype=torch.float32).load_quantized(codes, books, scales)
    x = torch.randn(3, 64)
    expect = x.double() @ dequantize(codes, books.double(), scales.double(), dtype=torch.float64).T
    assert torch.allclose(layer(x).double(), expect, rtol=1e-5, atol=1e-5)


def test_cpu_layer_never_binds_and_copies_without_a_binding():
    """The bound decode launch is a CUDA shortcut: a CPU layer (the reference path) makes none, and
    a layer's pickled or copied state never carries one (its pointers belong to the original)."""
    import copy
    import pickle

    layer = VQLinear(64, 24, dtype=torch.float32)
    layer.load_quantized(*make_weight(24, 64, torch.float32, "cpu"))
    y = layer(torch.randn(1, 64))
    assert layer._bound is None and y.shape == (1, 24)
    layer._bound = object()                      # stands for a binding: neither copy may keep it
    assert copy.deepcopy(layer)._bound is None and pickle.loads(pickle.dumps(layer))._bound is None
    assert layer._bound is not None


def test_compiled_layer_never_reaches_the_binding():
    """``torch.compile(fullgraph=True)`` traces ``vq_matmul``'s custom op, never the bound launch
    (whose checks read pointers, which a traced fake tensor has not): a binding that fails when
    touched stays untouched under compilation, while an eager call does reach it."""
    from tilefuse.ops.vq.op import vq_matmul

    class Trap:
        def accepts(self, *args):
            raise AssertionError("the binding was consulted")

    layer = VQLinear(64, 24, dtype=torch.float32)
    layer.load_quantized(*make_weight(24, 64, torch.float32, "cpu"))
    layer._bound = Trap()
    x = torch.randn(2, 64)
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, vq_matmul(x, layer.codes, layer.codebooks, layer.scales, layer.bias))
    with pytest.raises(AssertionError, match="consulted"):
        layer(x)


@pytest.mark.parametrize("with_bias", [True, False])
def test_bound_dequant_passes_the_launcher_what_the_kernel_launch_does(monkeypatch, with_bias):
    """The bound dequantize path marshals the compiled launcher's arguments itself (grid, stream,
    head, codes, codebooks, scales, the fresh W buffer, the sizes, tail); checked on the CPU
    against ``Kernel.launch`` of the same kernel and tensors, both through a recording launcher,
    and the result is ``x W^T (+ bias)`` of the W buffer the kernel fills."""
    from tilefuse.ops.vq import op

    n, k = 48, 64
    codes, codebooks, scales = make_weight(n, k, torch.float32, "cpu")
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(1, k)
    kernel = op._kernel("kernels", "vq_dequant_kernel")
    key = op._dequant_key(x.dtype, codes, codebooks, scales, n, k, op.DEQUANT_LAUNCH)
    w_value = dequantize(codes, codebooks, scales, dtype=torch.float32)
    calls, buffers = [], {}

    def launcher(*args):         # records, and fills the W buffer as the kernel would
        calls.append(args)
        w_ptr = args[4 + 1 + 3]
        if w_ptr in buffers:
            buffers[w_ptr].copy_(w_value)

    real_empty = torch.empty

    def empty(*shape, **kwargs):      # the bound call's W buffer, found again by its pointer
        t = real_empty(*shape, **kwargs)
        buffers[t.data_ptr()] = t
        return t

    monkeypatch.setitem(kernel._compiled, key, (launcher, ("head",), ("tail",), None))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    call = op._Call()
    call.out_shape, call.variant, call.mma, call.prefill = (1, n), "dequant", None, None
    bound = op._bind_dequant(x, call, codes, codebooks, scales, bias)
    assert isinstance(bound, op.BoundDequant)
    monkeypatch.setattr(torch, "empty", empty)
    y = bound(x)
    monkeypatch.setattr(torch, "empty", real_empty)
    w = torch.empty(n, k)
    kernel.launch(key, op._dequant_grid(n, k, op.DEQUANT_LAUNCH), None, (codes, codebooks, scales, w),
                  (n, k // 8, k // 4, k), dict(op.DEQUANT_LAUNCH))
    bound_args, launch_args = calls
    w_at = 4 + 1 + 3
    assert bound_args[:3] == launch_args[:3] and bound_args[3] == 77
    assert bound_args[4:w_at] + bound_args[w_at + 1:] == launch_args[4:w_at] + launch_args[w_at + 1:]
    expect = x @ w_value.t() + (bias if bias is not None else 0)
    torch.testing.assert_close(y, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,m", [(4096, 4096, 1), (1024, 14336, 2), (6144, 1024, 4), (4096, 4096, 8),
                                   (14336, 4096, 16), (256, 1536, 1), (256, 1536, 16)])
def test_gpu_bound_decode_is_the_op_and_follows_the_layer(n, k, m):
    """A VQLinear's decode-size calls after the first take its bound launch (the host-cost
    shortcut) where ``vq_matmul`` runs a one-launch decode kernel (resident table: 1-4 tokens; MMA:
    up to 16) or the dequantize path (small layers: 256 x 1536, Qwen2.5-1.5B's key and value
    projections): the same result as ``vq_matmul`` on fresh inputs (to the split-K atomics'
    summation order); weights loaded in place are read (same pointers); new buffers (``.to``), a strided or
    misaligned input, ``force()``, gradients and CUDA-graph capture each leave it or rebind, and
    stay correct. The shapes cover one K slice and split K (the scratch partials)."""
    from tilefuse._launch import capture_graph
    from tilefuse.ops.vq.op import vq_matmul

    torch.manual_seed(n + k + m)
    layer = VQLinear(k, n, bias=True, dtype=torch.float16, device="cuda")
    layer.load_quantized(*make_weight(n, k, torch.float16, "cuda"), torch.randn(n, device="cuda").half())

    def op(x):
        return vq_matmul(x, layer.codes, layer.codebooks, layer.scales, layer.bias)

    def fresh():
        return torch.randn(m, k, device="cuda", dtype=torch.float16)

    def same(a, b):      # split K adds fp32 partials atomically: the order (and the last bit) varies
        return torch.allclose(a.float(), b.float(), atol=4e-3, rtol=4e-3)

    x = fresh()
    variant = tilefuse.explain("vq_matmul", x, layer.codes, layer.codebooks, layer.scales, layer.bias).variant
    assert same(layer(x), op(x))
    assert (layer._bound is not None) == (variant in ("decode", "mma", "small", "dequant")), variant
    if layer._bound is None:
        return
    bound = layer._bound
    for _ in range(3):
        x = fresh()
        assert bound.accepts(x, layer.codes, layer.codebooks, layer.scales, layer.bias)
        assert same(layer(x), op(x))
    layer.load_quantized(*make_weight(n, k, torch.float16, "cuda"), torch.randn(n, device="cuda").half())
    x = fresh()
    assert layer._bound is bound and same(layer(x), op(x))           # in place: same binding, new values
    wide = torch.randn(m, k + 8, device="cuda", dtype=torch.float16)[:, 1:k + 1]   # strided, misaligned
    assert same(layer(wide), op(wide.contiguous()))
    odd = torch.randn(m * k + 1, device="cuda", dtype=torch.float16)[1:].view(m, k)  # contiguous, 2-byte aligned
    assert not bound.accepts(odd, layer.codes, layer.codebooks, layer.scales, layer.bias)
    assert same(layer(odd), op(odd))
    with tilefuse.force(variant="dequant"):
        assert not bound.accepts(x, layer.codes, layer.codebooks, layer.scales, layer.bias)
        torch.testing.assert_close(layer(x).float(), op(x).float(), atol=2e-2, rtol=2e-2)
    xg = x.clone().requires_grad_(True)
    yg = layer(xg)
    yg.float().sum().backward()
    assert yg.grad_fn is not None and xg.grad is not None and torch.isfinite(xg.grad).all()
    # capture: the replay reads the input buffer and writes its own output
    static = fresh()
    graph, out = capture_graph(lambda: layer(static))
    for _ in range(2):
        static.copy_(fresh())
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, op(static))
    old = layer._bound
    layer.to(torch.bfloat16)                                                  # new buffers
    xb = x.bfloat16()
    assert not old.accepts(xb, layer.codes, layer.codebooks, layer.scales, layer.bias)
    assert same(layer(xb), op(xb)) and layer._bound is not old and layer._bound.dtype == torch.bfloat16



@pytest.mark.parametrize("lead", [(0,), (3, 0)])
def test_empty_batch(interpret, lead):
    """An MoE expert no token was routed to: ``[..., 0, K]`` in, ``[..., 0, N]`` out in the layer's
    dtype (before: ZeroDivisionError in the dispatch's cost model)."""
    layer = VQLinear(64, 24, bias=True).to(interpret)
    layer.load_quantized(*make_weight(24, 64, torch.float16, "cpu"))
    y = layer(torch.randn(*lead, 64, device=interpret).half())
    assert y.shape == (*lead, 24) and y.dtype == torch.float16 and y.device.type == interpret.type


class _GatedMLP(nn.Module):
    """An HF-style SwiGLU MLP (LlamaMLP's attribute names) of 2-bit gate/up and a dense down."""

    def __init__(self, hidden=64, inter=48, dtype=torch.float16, act=None, bias=False):
        super().__init__()
        self.gate_proj = VQLinear(hidden, inter, bias=bias, dtype=dtype)
        self.up_proj = VQLinear(hidden, inter, bias=bias, dtype=dtype)
        for layer in (self.gate_proj, self.up_proj):
            layer.load_quantized(*make_weight(inter, hidden, dtype, "cpu"))
            if bias:
                layer.bias.copy_(torch.randn(inter).to(dtype))
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inter", [128, 48])
def test_vq_swiglu_mlp_is_the_mlp_with_one_gate_up_call(interpret, bias, inter, monkeypatch):
    """VQSwiGLUMLP shares the MLP's layers and keeps its state-dict keys. Where vq_swiglu fuses
    (N and K multiples of 128: the small-layer kernel's sizes) gate/up run as that one call, never
    the layers' own forward; elsewhere through the layers (their bound launches) and the same
    one-pass epilogue, bit for bit what vq_swiglu returns. Either way the MLP's output to the fp64
    spec's rounding: ``silu(g) u`` rounded once vs the MLP's g, u, silu(g) and product each rounded
    to fp16, then the same dense down_proj: within 4 fp16 ulps of the hidden values times |W_down|."""
    from tilefuse.nn import VQSwiGLUMLP
    from tilefuse.ops.vq import op as vq_op

    torch.manual_seed(0)
    mlp = _GatedMLP(hidden=128, inter=inter, bias=bias).to(interpret)
    fused = VQSwiGLUMLP.from_mlp(mlp)
    assert fused.gate_proj is mlp.gate_proj and fused.down_proj is mlp.down_proj
    assert list(fused.state_dict()) == list(mlp.state_dict())
    x = torch.randn(2, 3, 128).half().to(interpret)
    g, u = mlp.gate_proj, mlp.up_proj
    weights = (g.codes, g.codebooks, g.scales, u.codes, u.codebooks, u.scales, g.bias, u.bias)
    assert vq_op.swiglu_fuses(x, *weights) is (inter == 128)
    calls = []
    layer_forward = VQLinear.forward
    monkeypatch.setattr(VQLinear, "forward", lambda self, x: calls.append(self) or layer_forward(self, x))
    got = fused(x)
    assert calls == ([] if inter == 128 else [g, u]) and got.shape == (2, 3, 128) and got.dtype == torch.float16
    assert torch.equal(got, mlp.down_proj(tilefuse.vq_swiglu(x, *weights)))
    monkeypatch.undo()
    want = mlp(x)
    h = nn.functional.silu(g(x).float()) * u(x).float()
    bound = 4 * 2 ** -10 * (h.abs() @ mlp.down_proj.weight.float().abs().T) + 1e-3
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_vq_swiglu_mlp_refuses_what_it_cannot_fuse():
    from tilefuse.nn import VQSwiGLUMLP
    from tilefuse.nn.vq import unfusable_mlp

    assert unfusable_mlp(_GatedMLP()) is None
    with pytest.raises(ValueError, match="mlp: expected a SiLU act_fn.*GELU"):
        VQSwiGLUMLP.from_mlp(_GatedMLP(act=nn.GELU()))
    dense_gate = _GatedMLP()
    dense_gate.gate_proj = nn.Linear(64, 48)
    with pytest.raises(ValueError, match="mlp: expected gate_proj to be a VQLinear.*got Linear"):
        VQSwiGLUMLP.from_mlp(dense_gate)
    odd = _GatedMLP()
    odd.up_proj = VQLinear(64, 40)
    with pytest.raises(ValueError, match="one shape, got 48x64 and 40x64"):
        VQSwiGLUMLP.from_mlp(odd)
    with pytest.raises(ValueError, match="has no \\['gate_proj'"):
        VQSwiGLUMLP.from_mlp(nn.Linear(8, 8))


def test_vq_swiglu_mlp_runs_wrapped_layers_and_gradients_through_the_layers(interpret, monkeypatch):
    """A child replaced since by another module, or a gradient wanted (vq_swiglu has no
    backward): the layers' own forwards, as the MLP replaced ran them; the gradient reaches the
    codebooks. A column-parallel shard that returns its local VQLinear's output as is (``local``,
    ``gather_output`` False, as tilefuse.parallel.ColumnParallel) stays fused: no layer forward."""
    from tilefuse.nn import VQSwiGLUMLP

    torch.manual_seed(1)
    mlp = _GatedMLP(hidden=128, inter=128).to(interpret)
    fused = VQSwiGLUMLP.from_mlp(mlp)
    x = torch.randn(3, 128).half().to(interpret)
    want = mlp(x)

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    fused.gate_proj = Wrapper(mlp.gate_proj)
    assert torch.equal(fused(x), want)

    class Shard(Wrapper):
        def __init__(self, inner, gather_output):
            super().__init__(inner)
            self.local, self.gather_output = inner, gather_output

    calls = []
    layer_forward = VQLinear.forward
    monkeypatch.setattr(VQLinear, "forward", lambda self, x: calls.append(self) or layer_forward(self, x))
    fused.gate_proj, fused.up_proj = Shard(mlp.gate_proj, False), Shard(mlp.up_proj, False)
    got = fused(x)
    assert calls == [] and torch.equal(got, mlp.down_proj(tilefuse.vq_swiglu(x, *_weights(mlp))))
    fused.up_proj = Shard(mlp.up_proj, True)            # gathered output: not the local rows
    assert torch.equal(fused(x), want) and calls == [mlp.gate_proj, mlp.up_proj]
    monkeypatch.undo()
    fused.gate_proj, fused.up_proj = mlp.gate_proj, mlp.up_proj
    mlp.up_proj.codebooks.requires_grad_(True)
    with torch.enable_grad():
        out = fused(x)
        out.float().sum().backward()
    assert torch.equal(out.detach(), want) and mlp.up_proj.codebooks.grad is not None


def _weights(mlp):
    g, u = mlp.gate_proj, mlp.up_proj
    return (g.codes, g.codebooks, g.scales, u.codes, u.codebooks, u.scales, g.bias, u.bias)
