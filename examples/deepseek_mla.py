"""A DeepSeek-V3-shaped model decoding through tilefuse's MLA kernel, against the stock model.

    python examples/deepseek_mla.py                        # tiny random DeepSeek-V3 (4 heads): seconds on a CPU
    python examples/deepseek_mla.py --real --layers 4 --heads 16 --device cuda   # DeepSeek-V3's shapes

tilefuse.hf.patch_mla(model) makes every attention layer decode in MLA's absorbed form through
tilefuse.flash_mla_with_kvcache over a paged latent cache (576 values per token per layer); the
prompt still runs transformers' own attention. tilefuse.hf.generate builds that cache, captures
the decode step in a CUDA graph on a GPU (step by step on a CPU) and continues the prompts.

The op needs DeepSeek's latent: kv_lora_rank 512 and qk_rope_head_dim 64 (both here). The
blocks are dense MLPs (first_k_dense_replace = layers): transformers' MoE blocks pick their
experts on the host, which a CUDA graph cannot capture. On a CPU (fp32, the op's PyTorch
reference) the greedy tokens equal the stock model's; on a GPU (bf16, the kernels) they agree
until two candidate tokens are within bf16 rounding of each other.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import tilefuse.hf


def config(real: bool, layers: int, heads: int) -> transformers.DeepseekV3Config:
    """DeepSeek-V3's attention shapes (--real: hidden 7168, q LoRA 1536, KV LoRA 512, RoPE 64,
    nope 128, v 128, vocab 129280) or a tiny model with the same latent (hidden 64)."""
    shapes = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, q_lora_rank=1536,
                  qk_nope_head_dim=128, v_head_dim=128) if real else \
        dict(vocab_size=256, hidden_size=64, intermediate_size=96, q_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32)
    return transformers.DeepseekV3Config(
        **shapes, num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        max_position_embeddings=8192, initializer_range=0.02 if real else 0.1, tie_word_embeddings=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="DeepSeek-V3's shapes (random weights; use a GPU)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="query heads (DeepSeek-V3: 128; 16 per GPU under TP8)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=12, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = config(args.real, args.layers, args.heads)
    torch.manual_seed(0)
    with torch.device(device):
        stock = transformers.DeepseekV3ForCausalLM(cfg).to(dtype).eval()
    patched = copy.deepcopy(stock)
    print(f"[example] patch_mla: {tilefuse.hf.patch_mla(patched)} attention layers on {device} in {dtype}")

    # left-padded prompts of different lengths, as a tokenizer with padding_side="left" makes them
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt), device=device)
    mask = torch.ones_like(ids)
    mask[1:, : args.prompt // 3] = 0
    ids = ids.masked_fill(mask == 0, 0)

    results = {}
    for name, model in (("stock", stock), ("patch_mla", patched)):
        for _ in range(2 if device.type == "cuda" else 1):      # on a GPU the first call captures the graph
            start = time.perf_counter()
            out = tilefuse.hf.generate(model, ids, args.new_tokens, attention_mask=mask)
            if device.type == "cuda":
                torch.cuda.synchronize()
        results[name] = out[:, args.prompt:]
        print(f"{name:<10} {time.perf_counter() - start:6.2f} s  first request's tokens: {results[name][0].tolist()}")

    same = results["stock"] == results["patch_mla"]
    print(f"[example] tokens equal to stock's: {int(same.sum())} of {same.numel()}")
    # fp32 on a CPU: the same tokens; bf16 on a GPU: rounding may flip a near-tie, so only report
    return 0 if device.type == "cuda" or bool(same.all()) else 1


if __name__ == "__main__":
    sys.exit(main())
