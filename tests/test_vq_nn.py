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
