"""AQLM's Hugging Face checkpoint format for 2x8 models, written and read without the ``aqlm``
package.

A checkpoint in this format is a directory with ``config.json`` whose ``quantization_config`` is
AQLM's (``quant_method: "aqlm"``, ``num_codebooks: 2``, ``nbits_per_codebook: 8``,
``in_group_size: 8``, ``out_group_size: 1``, ``linear_weights_not_to_quantize``: the ``nn.Linear``
weights left dense) and safetensors weights in which every 2-bit layer holds ``codes`` (int8
``[N, K/8, 2]``), ``codebooks`` (``[2, 256, 1, 8]``), ``scales`` (``[N, 1, 1, 1]``) and ``bias``
where it has one: AQLM's ``QuantizedLinear`` and :class:`tilefuse.nn.VQLinear` hold the same
tensors under the same names. :func:`save_aqlm` writes a model patched by
:func:`tilefuse.hf.patch_vq` in it (the layout transformers' AQLM integration reads with
``from_pretrained`` where the ``aqlm`` package is installed; not tested here, where it is not);
:func:`load_aqlm` builds the model of such a directory
(AQLM's published 2x8 checkpoints, or :func:`save_aqlm`'s) with :class:`VQLinear` layers, so it
decodes on tilefuse's kernels.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from torch import nn

from tilefuse import _checks

AQLM_2X8 = {"quant_method": "aqlm", "num_codebooks": 2, "nbits_per_codebook": 8, "in_group_size": 8,
            "out_group_size": 1}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def save_aqlm(model: nn.Module, path) -> Path:
    """Write ``model`` (a transformers model patched by :func:`tilefuse.hf.patch_vq`) to the
    directory ``path`` as an AQLM 2x8 checkpoint: ``config.json`` (the model's config with AQLM's
    ``quantization_config``; every ``nn.Linear`` weight left dense listed in
    ``linear_weights_not_to_quantize``) and ``model.safetensors`` (the state dict; 2-bit codes as
    int8, AQLM's dtype for 8-bit codebooks; a weight tied to another saved once). Tokenizer files
    are the caller's to copy. Returns the directory."""
    from tilefuse.hf import _write_tensors           # safetensors, or torch's format without it
    from tilefuse.nn.vq import VQLinear

    quantized = {name for name, mod in model.named_modules() if isinstance(mod, VQLinear)}
    if not quantized:
        raise ValueError("model: expected a model patched by tilefuse.hf.patch_vq (no VQLinear module found)")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(f"model: expected a transformers model (with a .config), got {type(model).__name__}")
    dense = sorted(f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, nn.Linear))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    saved = copy.deepcopy(config)
    saved.quantization_config = {**AQLM_2X8, "linear_weights_not_to_quantize": dense}
    saved.save_pretrained(folder)
    state, seen = {}, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if key.endswith(".codes") and key.removesuffix(".codes") in quantized and tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.int8)                 # the same bits, AQLM's dtype
        where = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if tensor.numel() and where in seen:                 # tied weights: the first name only
            continue
        seen[where] = key
        state[key] = tensor.contiguous()
    _write_tensors(state, folder / WEIGHTS)
    return folder


def load_aqlm(path, *, dtype: torch.dtype = torch.float16, device="cpu", fuse_gate_up: bool = True) -> nn.Module:
    """Build the model of an AQLM 2x8 checkpoint directory ``path`` (``config.json`` with AQLM's
    ``quantization_config``, safetensors weights in one file or shards with an index) with a
    :class:`tilefuse.nn.VQLinear` for every layer the checkpoint holds ``codes`` for, load its
    weights (every key must match; a tied output head is tied again) and return it in eval mode
    on ``device``. ``dtype``: the dense weights' and the codebooks' dtype. The model is built on
    the CPU without initialising its weights (the dense shells of the 2-bit layers are never
    written, so they take address space rather than memory), the 2-bit layers replace them, the
    checkpoint is loaded, then the model moves to ``device``. ``fuse_gate_up``: SwiGLU MLPs whose
    gate and up projections are both 2-bit run them as one :func:`tilefuse.vq_swiglu` call
    (:func:`tilefuse.hf.fuse_vq_mlps`; the state dict keeps its keys)."""
    import transformers

    from tilefuse.hf import load_strict
    from tilefuse.nn.vq import VQLinear, _as_code_dtype

    _checks.check_bool("fuse_gate_up", fuse_gate_up)
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ValueError(f"path: expected a checkpoint directory with config.json, got {folder}")
    from tilefuse.hf import read_json

    config_json = read_json(config_file)
    if not isinstance(config_json, dict):
        raise ValueError(f"path: {config_file} must hold a JSON object (a model config), got "
                         f"{type(config_json).__name__}")
    quant = config_json.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ValueError(f"path: {config_file}: quantization_config must be an object, got {quant!r}")
    if quant.get("quant_method") != "aqlm":
        raise ValueError(f"path: expected an AQLM checkpoint (quantization_config.quant_method 'aqlm'), got "
                         f"{quant.get('quant_method')!r} in {config_file}")
    layout = {k: quant.get(k) for k in AQLM_2X8 if k != "quant_method"}
    wanted = {k: v for k, v in AQLM_2X8.items() if k != "quant_method"}
    if layout != wanted:
        raise ValueError(f"path: tilefuse runs AQLM's 2x8 format ({wanted}), the checkpoint is {layout}")
    state, sources = _read_checkpoint(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config               # the model is built dense, then patched here
    with torch.device("cpu"), _no_weight_init():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, linear in list(model.named_modules()):
        if f"{name}.codes" not in state:
            continue
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"path: the checkpoint has codes for {name}, which is a {type(linear).__name__} "
                             f"in {type(model).__name__}, not an nn.Linear")
        key = f"{name}.codes"
        codes = state[key]
        # AQLM stores int8 codes; uint8 keeps its dtype, wider integers in [0, 256) are narrowed
        # (checked here so that an error names the tensor and its file)
        codes_dtype = codes.dtype if codes.dtype in (torch.int8, torch.uint8) else torch.int8
        state[key] = _as_code_dtype(codes, codes_dtype, f"path: {sources.get(key, folder)}: tensor {key!r}")
        model.set_submodule(name, VQLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                           dtype=dtype, codes_dtype=codes_dtype))
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if getattr(config, "tie_word_embeddings", False) \
        else set()
    source = folder / WEIGHTS if (folder / WEIGHTS).exists() else f"the shards of {folder / WEIGHTS_INDEX}"
    load_strict(model, state, f"{source} ({type(model).__name__} with its 2-bit layers)", ignore_missing=tied)
    if tied:
        model.tie_weights()
    if fuse_gate_up:
        from tilefuse.hf import fuse_vq_mlps

        fuse_vq_mlps(model)
    return model.to(device).eval()


def _read_checkpoint(folder: Path) -> tuple[dict, dict]:
    """The state dict of ``model.safetensors``, or of the shards ``model.safetensors.index.json``
    names, and the file each tensor came from."""
    from tilefuse.hf import _read_tensors, read_json

    if (folder / WEIGHTS).exists():
        state = _read_tensors(folder / WEIGHTS)
        return state, dict.fromkeys(state, folder / WEIGHTS)
    index = folder / WEIGHTS_INDEX
    if not index.exists():
        raise ValueError(f"path: expected {WEIGHTS} or {WEIGHTS_INDEX} in {folder}")
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"path: {index} has no \"weight_map\" key mapping tensor names to shard files")
    state, sources = {}, {}
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).exists():
            raise ValueError(f"path: the shard {shard} that {index} names is not in {folder}")
        tensors = _read_tensors(folder / shard)
        state.update(tensors)
        sources.update(dict.fromkeys(tensors, folder / shard))
    return state, sources


@contextlib.contextmanager
def _no_weight_init():
    """transformers' context that skips the random initialisation of a model being built (its
    module moved between releases); nothing where it is not found."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            context = getattr(__import__(module, fromlist=["no_init_weights"]), "no_init_weights")
        except (ImportError, AttributeError):
            continue
        with context():
            yield
        return
    yield
