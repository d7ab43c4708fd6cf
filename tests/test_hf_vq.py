"""tilefuse.hf.patch_vq: swapping a model's projections for 2-bit VQLinear layers."""

import copy
import json

import pytest
import torch
from torch import nn

import tilefuse
from tilefuse.hf import VQ_PROJECTIONS, patch_vq
from tilefuse.nn.vq import VQLinear
from tilefuse.ops.vq.reference import dequantize


class ToyModel(nn.Module):
    """Token ids -> embedding -> up_proj -> ReLU -> down_proj, called like an HF model."""

    def __init__(self, hidden=64, inter=128, vocab=50, dtype=torch.bfloat16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=True, dtype=dtype)

    def forward(self, input_ids, use_cache=False):
        return self.down_proj(torch.relu(self.up_proj(self.embed(input_ids))))


def easy_weight(rows, cols, dtype=torch.bfloat16):
    """Every row: the same 8 random 8-vectors in a random order, so every row has the same RMS and
    the 8-groups take 8 distinct values, which the 2x8 format represents exactly."""
    atoms = torch.randn(cols // 8, 8)
    return torch.stack([atoms[torch.randperm(cols // 8)].flatten() for _ in range(rows)]).to(dtype)


def test_random_codes_replace_every_projection_with_dense_magnitudes():
    model = ToyModel(hidden=512, inter=256)
    dense = {name: model.get_submodule(name).weight.float().clone() for name in ("up_proj", "down_proj")}
    assert patch_vq(model, random_codes=True) == 2
    for name, weight in dense.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, VQLinear) and layer.codebooks.dtype == torch.bfloat16
        rms = layer.dequantize().float().pow(2).mean(1).sqrt()
        torch.testing.assert_close(rms, weight.pow(2).mean(1).sqrt(), rtol=0.15, atol=0)  # codes: K/8 = 32-64 groups
    with tilefuse.force(backend="reference"):
        out = model(torch.randint(0, 50, (2, 5)))
    assert out.shape == (2, 5, 512) and torch.isfinite(out).all()


def test_calibration_hooks_pass_each_layer_its_inputs_gram(monkeypatch):
    model = ToyModel()
    ids = [torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (9,))]
    with torch.no_grad():
        x_up = torch.cat([model.embed(i).reshape(-1, 64) for i in ids]).float()
        x_down = torch.relu(model.up_proj(torch.cat([model.embed(i).reshape(-1, 64) for i in ids]))).float()
    seen = {}

    def fake_quantize(weight, calib, **opts):
        seen[tuple(weight.shape)] = (calib, opts)
        n, k = weight.shape
        return (torch.zeros(n, k // 8, 2, dtype=torch.uint8), torch.zeros(2, 256, 1, 8, dtype=weight.dtype),
                torch.ones(n, 1, 1, 1, dtype=weight.dtype))

    monkeypatch.setattr(tilefuse.quantizer, "quantize", fake_quantize)
    assert patch_vq(model, ids, iters=2, progress=False) == 2
    torch.testing.assert_close(seen[(128, 64)][0], x_up.T @ x_up, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(seen[(64, 128)][0], x_down.T @ x_down, rtol=1e-4, atol=1e-3)
    assert seen[(128, 64)][1]["iters"] == 2 and seen[(128, 64)][1]["seed"] == 0


def test_calibrated_easy_weights_keep_the_outputs():
    model = ToyModel()
    with torch.no_grad():
        model.up_proj.weight.copy_(easy_weight(128, 64) * 0.1)
        model.down_proj.weight.copy_(easy_weight(64, 128) * 0.1)
    ids = torch.randint(0, 50, (4, 16))
    with tilefuse.force(backend="reference"):
        before = model(ids).float()
        assert patch_vq(model, ids, iters=2, init_iters=4, progress=False) == 2
        after = model(ids).float()
    err = (after - before).norm() / before.norm()
    assert err < 0.03, f"relative output error {err:.4f}"


def test_progress_by_default_when_quantizing(capsys):
    """Quantizing (with or without calibration) takes minutes on a real model: one line for the
    calibration pass and one per layer on stderr by default; progress=False silences it; random
    codes (fast) stay quiet unless asked. tilefuse.quantize's per-stage lines stay off."""
    ids = torch.randint(0, 50, (2, 8))
    patch_vq(ToyModel(), ids, iters=1, init_iters=2, feedback=0)
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert "calibration" in lines[0] and "2 layers" in lines[0] and "16 tokens" in lines[0]
    assert [line.split("]")[0] for line in lines if line.startswith("patch_vq [")] == ["patch_vq [1/2", "patch_vq [2/2"]
    assert "s left" in lines[-1] and "tilefuse.quantize" not in out.err
    patch_vq(ToyModel(), iters=1, init_iters=2)                         # no calibration: still quantizing
    assert capsys.readouterr().err.count("patch_vq [") == 2
    patch_vq(ToyModel(), ids, iters=1, init_iters=2, progress=False)
    patch_vq(ToyModel(), iters=1, init_iters=2, progress=False)
    patch_vq(ToyModel(), random_codes=True)
    assert capsys.readouterr().err == ""
    patch_vq(ToyModel(), random_codes=True, progress=True)
    assert capsys.readouterr().err.count("patch_vq [") == 2
    with pytest.raises(ValueError, match="progress"):
        patch_vq(ToyModel(), random_codes=True, progress="yes")


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="calibration"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), random_codes=True)
    with pytest.raises(ValueError, match="calibration"):
        patch_vq(ToyModel(), torch.randn(2, 4))                       # not token ids
    with pytest.raises(ValueError, match="calibration"):
        patch_vq(ToyModel(), "some text")
    with pytest.raises(ValueError, match="model: expected nn.Linear"):
        patch_vq(nn.Sequential(nn.ReLU()), random_codes=True)         # no target Linear
    odd = ToyModel()
    odd.up_proj = nn.Linear(60, 128)
    with pytest.raises(ValueError, match="in_features must be a multiple of 8"):
        patch_vq(odd, random_codes=True)
    with pytest.raises(ValueError, match="targets"):
        patch_vq(ToyModel(), random_codes=True, targets="up_proj")
    model = ToyModel()
    patch_vq(model, random_codes=True, targets=("down_proj",))
    assert isinstance(model.down_proj, VQLinear) and isinstance(model.up_proj, nn.Linear)


@pytest.mark.parametrize("calibrated", [False, True])
def test_real_llama_every_projection(calibrated):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 16))
    with tilefuse.force(backend="reference"), torch.no_grad():
        before = model(ids).logits.float()
        if calibrated:
            replaced = patch_vq(model, ids, iters=1, init_iters=2, feedback=0, progress=False)
        else:
            replaced = patch_vq(model, random_codes=True)
        after = model(ids).logits.float()
    assert replaced == 2 * len(VQ_PROJECTIONS)
    names = [n for n, m in model.named_modules() if isinstance(m, VQLinear)]
    assert {n.rpartition(".")[2] for n in names} == set(VQ_PROJECTIONS)
    assert isinstance(model.lm_head, nn.Linear) and torch.isfinite(after).all()
    if calibrated:  # 2 bits on random weights: a rough copy, clearly correlated with the dense logits
        assert nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0) > 0.5


def _tiny_2bit_llama(seed: int, tied: bool = False):
    """(config, a tiny Llama patched by patch_vq with random codes, input ids, its logits on them)."""
    from tilefuse.bench import hf_models

    config = hf_models.tiny_llama_config(2)
    config.tie_word_embeddings = tied
    model = hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=seed)
    patch_vq(model, random_codes=True)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        return config, model, ids, model(input_ids=ids).logits


def test_save_and_load_a_2bit_model(tmp_path):
    """save_vq writes the state dict (AQLM's names for the 2-bit layers) and which modules are
    2-bit; load_vq rebuilds them in a fresh model of the same config: the same outputs."""
    transformers = pytest.importorskip("transformers")

    from tilefuse.bench import hf_models
    from tilefuse.hf import load_vq, save_vq

    config, model, ids, want = _tiny_2bit_llama(seed=1)
    folder = save_vq(model, tmp_path / "vq")
    assert (folder / "tilefuse_vq.json").exists() and (folder / "model.safetensors").exists()
    keys = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.codes" in keys and "model.layers.0.self_attn.q_proj.codebooks" in keys
    fresh = hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=2)
    load_vq(fresh, folder)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match="save_vq"):
        load_vq(fresh, tmp_path)
    with pytest.raises(ValueError, match="patch_vq"):
        save_vq(hf_models.random_model(config, torch.device("cpu"), torch.float32), tmp_path / "dense")
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, hidden_size=32,
                                                                   intermediate_size=64, num_hidden_layers=2,
                                                                   num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="the saved layer is"):
        load_vq(other, folder)


def _edit_json(file, edit):
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def test_load_vq_names_the_file_at_fault(tmp_path):
    """A directory save_vq did not write as it is: corrupt JSON, no "modules", an unknown
    codes_dtype, int32 codes out of [0, 256), weights that do not match: ValueError naming the file
    (and the key or tensor), never an AttributeError, a JSONDecodeError without the file, or a
    strict-load error blaming an argument the caller never passed."""
    pytest.importorskip("transformers")
    from tilefuse.bench import hf_models
    from tilefuse.hf import _read_tensors, _write_tensors, load_vq, save_vq

    config, model, ids, want = _tiny_2bit_llama(seed=6)
    folder = save_vq(model, tmp_path / "vq")
    spec, weights = folder / "tilefuse_vq.json", folder / "model.safetensors"
    good_spec, state = spec.read_text(), _read_tensors(weights)

    def load():
        return load_vq(hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=7), folder)

    spec.write_text(good_spec[:-20])
    with pytest.raises(ValueError, match=f"{spec}.*not valid JSON"):
        load()
    spec.write_text(good_spec)
    _edit_json(spec, lambda d: d.pop("modules"))
    with pytest.raises(ValueError, match=f"{spec}.*\"modules\""):
        load()
    spec.write_text(good_spec)
    _edit_json(spec, lambda d: d["modules"]["model.layers.0.mlp.up_proj"].update(codes_dtype="nonexistent"))
    with pytest.raises(ValueError, match="codes_dtype must be one of \\('int8', 'uint8'\\), got 'nonexistent'"):
        load()
    spec.write_text(good_spec)
    _edit_json(spec, lambda d: d["modules"]["model.layers.0.mlp.up_proj"].pop("out_features"))
    with pytest.raises(ValueError, match="up_proj.*out_features"):
        load()
    spec.write_text(good_spec)
    # int32 codes in [0, 256) load (the same values); out of range, the tensor and its file are named
    key = "model.layers.1.self_attn.o_proj.codes"
    wide = dict(state, **{key: state[key].view(torch.uint8).to(torch.int32)})
    _write_tensors(wide, weights)
    with torch.no_grad():
        assert torch.equal(load()(input_ids=ids).logits, want)
    wide[key][0, 0, 0] = 300
    _write_tensors(wide, weights)
    with pytest.raises(ValueError, match=f"{weights}: tensor '{key}': expected values in \\[0, 256\\)"):
        load()
    _write_tensors({k: v for k, v in state.items() if k != "lm_head.weight"}, weights)
    with pytest.raises(ValueError, match=f"weights in {weights} do not match.*lm_head.weight"):
        load()
    _write_tensors(state, weights)
    with torch.no_grad():
        assert torch.equal(load()(input_ids=ids).logits, want)


def test_load_aqlm_names_the_file_at_fault(tmp_path):
    """load_aqlm: corrupt config.json or index, int32 codes (narrowed where in range; out of range
    the tensor and file are named, not a codes_dtype argument the caller never passed)."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors.torch")
    from tilefuse.hf import _read_tensors, _write_tensors, load_aqlm, save_aqlm

    _, model, ids, want = _tiny_2bit_llama(seed=8)
    folder = save_aqlm(model, tmp_path / "aqlm")
    config, weights = folder / "config.json", folder / "model.safetensors"
    good_config, state = config.read_text(), _read_tensors(weights)
    config.write_text(good_config.replace("}", "", 1))
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        load_aqlm(folder, dtype=torch.float32)
    config.write_text(good_config)
    key = "model.layers.0.mlp.down_proj.codes"
    wide = dict(state, **{key: state[key].view(torch.uint8).to(torch.int32)})
    _write_tensors(wide, weights)
    with torch.no_grad():
        assert torch.equal(load_aqlm(folder, dtype=torch.float32)(input_ids=ids).logits, want)
    wide[key][1, 2, 1] = -5
    _write_tensors(wide, weights)
    with pytest.raises(ValueError, match=f"{weights}: tensor '{key}': expected values"):
        load_aqlm(folder, dtype=torch.float32)
    weights.unlink()
    index = folder / "model.safetensors.index.json"
    _write_tensors(state, folder / "shard.safetensors")
    index.write_text('{"weight_map": {')
    with pytest.raises(ValueError, match=f"{index} is not valid JSON"):
        load_aqlm(folder, dtype=torch.float32)
    index.write_text('{"weights": {}}')
    with pytest.raises(ValueError, match=f"{index} has no \"weight_map\""):
        load_aqlm(folder, dtype=torch.float32)
    index.write_text(json.dumps({"weight_map": dict.fromkeys(state, "shard.safetensors")}))
    with torch.no_grad():
        assert torch.equal(load_aqlm(folder, dtype=torch.float32)(input_ids=ids).logits, want)


@pytest.mark.parametrize("tied", [False, True])
def test_aqlm_checkpoint_round_trip(tmp_path, tied):
    """save_aqlm writes a patch_vq model as AQLM's 2x8 checkpoint (config.json with AQLM's
    quantization_config, int8 codes under AQLM's names, a tied head saved once); load_aqlm
    builds it again with VQLinear layers: the same logits."""
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    from tilefuse.hf import load_aqlm, save_aqlm

    _, model, ids, want = _tiny_2bit_llama(seed=3, tied=tied)
    folder = save_aqlm(model, tmp_path / "aqlm")
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert {k: quant[k] for k in ("quant_method", "num_codebooks", "nbits_per_codebook", "in_group_size",
                                  "out_group_size")} == dict(quant_method="aqlm", num_codebooks=2,
                                                             nbits_per_codebook=8, in_group_size=8, out_group_size=1)
    assert "lm_head.weight" in quant["linear_weights_not_to_quantize"]
    saved = safetensors.load_file(str(folder / "model.safetensors"))
    assert saved["model.layers.1.mlp.down_proj.codes"].dtype == torch.int8
    assert ("lm_head.weight" in saved) != tied
    loaded = load_aqlm(folder, dtype=torch.float32)
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == "VQLinear"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)


def test_load_aqlm_reads_a_checkpoint_as_aqlm_writes_it(tmp_path):
    """A checkpoint laid out as AQLM's (int8 codes with negative values, fp16 codebooks and
    scales, weights in two shards with an index) loads into VQLinear layers whose model equals
    the dense model with the dequantized weights; other formats are refused by name."""
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    from tilefuse.bench import hf_models
    from tilefuse.hf import load_aqlm

    config = hf_models.tiny_llama_config(2)
    dense = hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=4)
    state = {key: t.clone() for key, t in dense.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    quantized = [name for name, mod in dense.named_modules() if isinstance(mod, nn.Linear) and name != "lm_head"]
    for name in quantized:
        n, k = dense.get_submodule(name).weight.shape
        codes = torch.randint(-128, 128, (n, k // 8, 2), generator=gen, dtype=torch.int32).to(torch.int8)
        books = (torch.randn(2, 256, 1, 8, generator=gen) * 0.7).half()
        scales = (torch.rand(n, 1, 1, 1, generator=gen) * 0.1 + 0.05).half()
        del state[f"{name}.weight"]
        state.update({f"{name}.codes": codes, f"{name}.codebooks": books, f"{name}.scales": scales})
        with torch.no_grad():
            dense.get_submodule(name).weight.copy_(dequantize(codes, books, scales, dtype=torch.float32))
    folder = tmp_path / "ckpt"
    saved = copy.deepcopy(config)
    saved.quantization_config = {"quant_method": "aqlm", "num_codebooks": 2, "nbits_per_codebook": 8,
                                 "in_group_size": 8, "out_group_size": 1,
                                 "linear_weights_not_to_quantize": ["lm_head.weight"]}
    saved.save_pretrained(folder)
    keys = sorted(state)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for file, names in shards.items():
        safetensors.save_file({key: state[key].contiguous() for key in names}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {key: file for file, names in shards.items() for key in names}}))
    model = load_aqlm(folder, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    one_by_16 = json.loads((folder / "config.json").read_text())
    one_by_16["quantization_config"].update(num_codebooks=1, nbits_per_codebook=16)
    (folder / "config.json").write_text(json.dumps(one_by_16))
    with pytest.raises(ValueError, match="2x8"):
        load_aqlm(folder)
    one_by_16.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(one_by_16))
    with pytest.raises(ValueError, match="AQLM checkpoint"):
        load_aqlm(folder)
    with pytest.raises(ValueError, match="config.json"):
        load_aqlm(tmp_path / "nothing")


def test_finetune_quantizes_block_by_block_and_tracks_the_dense_model_better(capsys):
    """patch_vq(finetune=N) on a tiny Llama (fp32, reference path): every projection becomes a
    VQLinear, block by block (one progress line per block with its output error before and after
    tuning), and the model's logits on held-out tokens are closer to the dense model's than with
    the one-pass calibration (the same quantizer settings; deterministic on the CPU)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(config).eval()
    calib = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    held_out = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(99))
    opts = dict(iters=1, init_iters=3, feedback=0)
    errors = {}
    for steps in (0, 40):
        model = transformers.LlamaForCausalLM(config).eval()
        model.load_state_dict(dense.state_dict())
        with tilefuse.force(backend="reference"):
            replaced = patch_vq(model, calib, finetune=steps, finetune_lr=1e-3, progress=steps > 0, **opts)
            with torch.no_grad():
                got, want = model(held_out).logits, dense(held_out).logits
        assert replaced == 2 * len(VQ_PROJECTIONS)
        assert sum(isinstance(m, VQLinear) for m in model.modules()) == replaced
        errors[steps] = ((got - want).norm() / want.norm()).item()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("patch_vq block")]
    assert len(lines) == 2 and all("block output error" in line and "s left" in line for line in lines)
    assert errors[40] < errors[0]


def test_finetune_errors_name_the_argument():
    with pytest.raises(ValueError, match="finetune: expected an int >= 0"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune=-1)
    with pytest.raises(ValueError, match="finetune: expected calibration"):
        patch_vq(ToyModel(), finetune=5)
    with pytest.raises(ValueError, match="finetune needs the target Linear modules inside a list"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune=5, progress=False)


def _sharp_tiny_llama(transformers):
    """(config, a tiny random Llama whose next-token distributions are sharpened (a random model's
    are near uniform, so their KL says little), 8 calibration windows of [2, 32] token ids)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    windows = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    return config, model, windows


def test_finetune_e2e_tunes_books_scales_and_norms_against_the_dense_distributions(capsys):
    """patch_vq(finetune_e2e=N) on a tiny Llama (fp32, reference path): after the quantization,
    every VQLinear's codebooks and scales (and the RMSNorm weights) are tuned so that the
    next-token distributions match the dense model's: the mean KL over the calibration windows
    falls, on held-out tokens too; the codes are untouched; with ``finetune_norms=False`` the norms
    stay the dense model's. Deterministic on the CPU."""
    transformers = pytest.importorskip("transformers")
    from tilefuse.hf.vq_sequential import _next_token_kl, head_inputs

    config, dense, calib = _sharp_tiny_llama(transformers)
    held_out = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(99))]
    opts = dict(iters=1, init_iters=3, feedback=0, progress=False)

    def held_out_kl(model):
        with torch.no_grad():
            return float(_next_token_kl(model(held_out[0]).logits, model.lm_head, head_inputs(dense, held_out)[0]))

    models = {}
    for e2e, norms in ((0, True), (60, True), (60, False)):
        model = transformers.LlamaForCausalLM(config).eval()
        model.load_state_dict(dense.state_dict())
        with tilefuse.force(backend="reference"):
            patch_vq(model, calib, finetune_e2e=e2e, finetune_e2e_lr=3e-4, finetune_norms=norms,
                     **{**opts, "progress": not norms})
        models[e2e, norms] = model
    base, tuned, books_only = models[0, True], models[60, True], models[60, False]
    with tilefuse.force(backend="reference"):
        kl = {key: held_out_kl(m) for key, m in models.items()}
    assert kl[60, True] < 0.9 * kl[0, True] and kl[60, False] < kl[0, True]
    for name, layer in tuned.named_modules():
        if isinstance(layer, VQLinear):
            other = base.get_submodule(name)
            assert torch.equal(layer.codes, other.codes) and not torch.equal(layer.codebooks, other.codebooks)
    assert not torch.equal(tuned.model.norm.weight, dense.model.norm.weight)
    assert torch.equal(books_only.model.norm.weight, dense.model.norm.weight)
    assert all(p.requires_grad for p in tuned.parameters())          # the model's own flags restored
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("patch_vq end to end")]
    assert len(lines) == 11 and "s left" in lines[0] and "KL" in lines[-1]     # the one run with progress


def test_finetune_e2e_errors_name_the_argument():
    with pytest.raises(ValueError, match="finetune_e2e: expected an int >= 0"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune_e2e=-1)
    with pytest.raises(ValueError, match="finetune_e2e_lr: expected a number > 0"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune_e2e=2, finetune_e2e_lr=0.0)
    with pytest.raises(ValueError, match="finetune_e2e: expected calibration"):
        patch_vq(ToyModel(), finetune_e2e=5)
    with pytest.raises(ValueError, match="get_output_embeddings"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune_e2e=5, progress=False)
    with pytest.raises(ValueError, match=r"finetune_e2e_held_out: expected an int from 0 to .* \(0\), got 1"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune_e2e=2, finetune_e2e_held_out=1)
    with pytest.raises(ValueError, match=r"finetune_e2e_schedule: expected one of \('constant', 'cosine'\)"):
        patch_vq(ToyModel(), torch.randint(0, 50, (4,)), finetune_e2e=2, finetune_e2e_schedule="step")


def test_finetune_e2e_held_out_windows_pick_the_state():
    """``tune_end_to_end(held_out=2)``: the last two calibration windows (which did not calibrate
    the quantization either) are not tuned on; the state kept is the one with the lowest KL on
    them among the checked steps, and the model holds exactly that state afterwards (its KL on
    those windows is the reported one)."""
    transformers = pytest.importorskip("transformers")
    from tilefuse.hf.vq_sequential import _next_token_kl, head_inputs, tune_end_to_end

    _, model, windows = _sharp_tiny_llama(transformers)
    dense = head_inputs(model, windows)
    with tilefuse.force(backend="reference"):
        patch_vq(model, windows[:6], iters=1, init_iters=3, feedback=0, progress=False)
        info = tune_end_to_end(model, windows, dense, steps=30, lr=3e-4, norms=True, progress=False, held_out=2)
        with torch.no_grad():
            held = sum(float(_next_token_kl(model(w).logits, model.lm_head, d))
                       for w, d in zip(windows[6:], dense[6:])) / 2
    assert info["best_step"] in (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30)
    assert held == pytest.approx(info["error_after"], rel=1e-4) and info["error_after"] <= info["error_before"]
    assert info["best_step"] > 0                       # this model's held-out KL does fall
    with pytest.raises(ValueError, match="held_out: expected 0 to 7"):
        tune_end_to_end(model, windows, dense, steps=1, lr=3e-4, norms=False, progress=False, held_out=8)


def test_code_step_moves_a_fraction_of_the_codes_down_the_kl():
    """``tune_codes_end_to_end`` (PV-tuning's discrete step) on a tiny quantized Llama (fp32,
    reference path): the mean KL over the calibration windows falls, at most ``fraction`` of each
    layer's groups change their codes, the codebooks and scales do not move, and the model holds
    exactly the reported state. A step far too long (the weights moved by 50 times their norm)
    raises the KL, so nothing is kept. Deterministic on the CPU."""
    transformers = pytest.importorskip("transformers")
    from tilefuse.hf.vq_sequential import _next_token_kl, head_inputs, tune_codes_end_to_end

    _, model, windows = _sharp_tiny_llama(transformers)
    dense = head_inputs(model, windows)
    with tilefuse.force(backend="reference"):
        patch_vq(model, windows, iters=1, init_iters=3, feedback=0, progress=False)
        layers = {name: m for name, m in model.named_modules() if isinstance(m, VQLinear)}
        before = {name: [t.clone() for t in (m.codes, m.codebooks, m.scales)] for name, m in layers.items()}
        info = tune_codes_end_to_end(model, windows, dense, step=0.1, fraction=0.05)
        with torch.no_grad():
            kl = sum(float(_next_token_kl(model(w).logits, model.lm_head, d)) for w, d in zip(windows, dense)) / 8
    assert info["accepted"] and info["error_after"] < info["error_before"] and info["error_tried"] == info["error_after"]
    assert kl == pytest.approx(info["error_after"], rel=1e-5)
    moved = 0
    for name, m in layers.items():
        codes, books, scales = before[name]
        changed = (m.codes != codes).any(-1)
        assert changed.float().mean() <= 0.05 + 1e-9 and m.codes.dtype == codes.dtype
        assert torch.equal(m.codebooks, books) and torch.equal(m.scales, scales)
        moved += int(changed.sum())
    assert moved > 0 and info["changed"] == pytest.approx(moved / sum(c.numel() // 2 for c, _, _ in before.values()))

    kept = {name: m.codes.clone() for name, m in layers.items()}
    with tilefuse.force(backend="reference"):
        wild = tune_codes_end_to_end(model, windows, dense, step=50.0, fraction=1.0)
    assert not wild["accepted"] and wild["changed"] == 0 and wild["error_after"] == wild["error_before"]
    assert wild["proposed"] > 0 and wild["error_tried"] > wild["error_before"]
    assert all(torch.equal(m.codes, kept[name]) for name, m in layers.items())


def test_finetune_pv_alternates_code_and_end_to_end_steps(capsys):
    """patch_vq(finetune_e2e=N, finetune_pv=R): after the end-to-end tuning, R rounds of a code
    step then N more end-to-end steps (their progress lines in that order); its settings are
    checked before any work, naming the argument."""
    transformers = pytest.importorskip("transformers")
    _, model, windows = _sharp_tiny_llama(transformers)
    with tilefuse.force(backend="reference"):
        patch_vq(model, windows, iters=1, init_iters=3, feedback=0, finetune_e2e=10, finetune_pv=2)
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith(("patch_vq code step", "patch_vq end to end:"))]
    assert [line.split(":")[0] for line in lines] == ["patch_vq end to end", "patch_vq code step"] * 2 + [
        "patch_vq end to end"]
    for kwargs, match in (({"finetune_pv": -1}, "finetune_pv: expected an int >= 0"),
                          ({"finetune_pv": 1}, "finetune_pv: expected finetune_e2e > 0"),
                          ({"finetune_pv": 1, "finetune_e2e": 2, "finetune_pv_step": 0}, "finetune_pv_step: expected a number > 0"),
                          ({"finetune_pv": 1, "finetune_e2e": 2, "finetune_pv_fraction": 1.5},
                           r"finetune_pv_fraction: expected a number in \(0, 1\]")):
        with pytest.raises(ValueError, match=match):
            patch_vq(ToyModel(), torch.randint(0, 50, (4,)), **kwargs)


def test_save_and_load_a_tied_2bit_model(tmp_path):
    """A model whose output head is tied to its embeddings (SmolLM2's) saves (safetensors refuses
    shared memory: the tied weight is written once) and loads back with the same logits, tied."""
    pytest.importorskip("transformers")
    from tilefuse.bench import hf_models
    from tilefuse.hf import load_vq, save_vq

    config, model, ids, want = _tiny_2bit_llama(seed=4, tied=True)
    folder = save_vq(model, tmp_path / "vq")
    fresh = hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=5)
    load_vq(fresh, folder)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, want)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("fuse", [True, False])
def test_patch_vq_fuses_each_swiglu_mlp_unless_told_not_to(fuse):
    """patch_vq's fuse_gate_up (default on): every LlamaMLP becomes a VQSwiGLUMLP over the same
    VQLinear layers (state-dict keys unchanged; save_vq / load_vq see the same 2-bit modules); the
    fp32 model (the reference on every device) gives the unfused model's logits within fp32
    rounding (the fused spec computes ``silu(g) u`` in one expression); fuse_vq_mlps again swaps
    nothing."""
    pytest.importorskip("transformers")
    from tilefuse.bench import hf_models
    from tilefuse.hf import fuse_vq_mlps
    from tilefuse.nn import VQSwiGLUMLP

    config = hf_models.tiny_llama_config(2)
    model = hf_models.random_model(config, torch.device("cpu"), torch.float32, seed=3)
    twin = copy.deepcopy(model)
    assert patch_vq(model, random_codes=True, fuse_gate_up=fuse) == 2 * len(VQ_PROJECTIONS)
    assert patch_vq(twin, random_codes=True, fuse_gate_up=False) == 2 * len(VQ_PROJECTIONS)
    mlps = [type(layer.mlp) for layer in model.model.layers]
    assert mlps == [VQSwiGLUMLP if fuse else type(twin.model.layers[0].mlp)] * 2
    assert list(model.state_dict()) == list(twin.state_dict())
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert fuse_vq_mlps(model) == 0 if fuse else fuse_vq_mlps(model) == 2
    with pytest.raises(ValueError, match="fuse_gate_up: expected True or False"):
        patch_vq(twin, random_codes=True, fuse_gate_up="yes")


def _tiny_qwen3_moe(seed: int):
    transformers = pytest.importorskip("transformers")
    from tilefuse.bench.hf_models import random_model

    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         decoder_sparse_step=1, max_position_embeddings=256)
    return config, random_model(config, torch.device("cpu"), torch.float32, seed=seed)


def test_save_and_load_a_2bit_moe_model(tmp_path, interpret):
    """A model with 2-bit experts (VQMoEExperts) and projections round-trips through save_vq /
    load_vq: the experts modules are listed apart ("experts") and rebuilt in a fresh model of the
    same config, the same outputs; a malformed experts entry or a model whose experts do not match
    raises ValueError naming the file or the module."""
    from tilefuse.hf import load_vq, save_vq
    from tilefuse.nn.vq_moe import VQMoEExperts

    config, model = _tiny_qwen3_moe(seed=3)
    assert patch_vq(model, random_codes=True, fuse_gate_up=False) == 2 * (4 + 1)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    folder = save_vq(model, tmp_path / "vq")
    spec = json.loads((folder / "tilefuse_vq.json").read_text())
    assert spec["experts"]["model.layers.1.mlp.experts"] == dict(num_experts=4, hidden_dim=64, intermediate_dim=32,
                                                                  codes_dtype="uint8")
    fresh = _tiny_qwen3_moe(seed=4)[1]
    load_vq(fresh, folder)
    assert isinstance(fresh.model.layers[0].mlp.experts, VQMoEExperts)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, want)

    good = (folder / "tilefuse_vq.json").read_text()
    _edit_json(folder / "tilefuse_vq.json", lambda d: d["experts"]["model.layers.0.mlp.experts"].update(hidden_dim=60))
    with pytest.raises(ValueError, match="experts\\['model.layers.0.mlp.experts'\\].*multiples of 8"):
        load_vq(_tiny_qwen3_moe(seed=4)[1], folder)
    (folder / "tilefuse_vq.json").write_text(good)
    _edit_json(folder / "tilefuse_vq.json", lambda d: d["experts"]["model.layers.0.mlp.experts"].update(num_experts=8))
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts is Qwen3MoeExperts.*saved experts"):
        load_vq(_tiny_qwen3_moe(seed=4)[1], folder)


MOE_CONFIGS = {
    "Qwen2MoeConfig": dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                           num_experts=4, num_experts_per_tok=2),
    "MixtralConfig": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "DeepseekV3Config": dict(intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                             kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                             v_head_dim=16, num_key_value_heads=4),
}


@pytest.mark.parametrize("config_name", sorted(MOE_CONFIGS))
def test_patch_vq_converts_the_stacked_experts_of_other_moe_models(config_name):
    """Qwen2-MoE (with a shared expert), Mixtral and DeepSeek-V3 keep their experts in the same
    stacked form; patch_vq converts them by form, and each model's output equals the stock model's
    with the experts' weights set to the 2-bit experts' dequantized values (fp32: the reference
    path), so the MoE block's own routing and weighting reach vq_moe unchanged."""
    transformers = pytest.importorskip("transformers")
    from tilefuse.bench.hf_models import random_model
    from tilefuse.nn.vq_moe import VQMoEExperts

    kwargs = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)
    config = getattr(transformers, config_name)(**{**kwargs, **MOE_CONFIGS[config_name]})
    model = random_model(config, torch.device("cpu"), torch.float32, seed=5)
    stock = copy.deepcopy(model)
    patch_vq(model, random_codes=True, targets=("o_proj",), fuse_gate_up=False)
    converted = {name: mod for name, mod in model.named_modules() if isinstance(mod, VQMoEExperts)}
    assert converted, f"{config_name}: no experts module converted"
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, VQMoEExperts):
                gate_up, down = mod.dequantize()
                stock.get_submodule(name).gate_up_proj.copy_(gate_up)
                stock.get_submodule(name).down_proj.copy_(down)
            elif isinstance(mod, VQLinear):
                stock.get_submodule(name).weight.copy_(mod.dequantize())
        ids = torch.tensor([[7, 3, 9, 1, 200, 42, 5]])
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
