"""Which calls make the host wait for the GPU during HF's eager ``generate``, stock and patched:
``torch.cuda.set_sync_debug_mode("warn")`` over one greedy decode, each synchronizing call
reported with the stack that made it (the last frames, innermost first), counted.

    python3 tools/sync_probe.py [--model deepseek-v3-h16] [--variants stock,mla] [--layers 2]
                                [--batch 16] [--prompt 256] [--new 16]

A synchronization per step makes the host wait for the GPU's queue to drain, so the step takes
the host's time plus the GPU's instead of the longer of the two. transformers' ``generate`` has
one per step of its own (the stopping criteria). Prints to stdout; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

from sweep_common import require_gpu

MODELS = ("llama3-8b", "qwen2.5-1.5b", "deepseek-v3", "deepseek-v3-h16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3-h16", choices=MODELS)
    parser.add_argument("--variants", default="stock,mla", help="of tilefuse bench model's variants")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    require_gpu()
    import torch

    from tilefuse.bench import hf_models
    from tilefuse.bench.hf_decode import generate_eager
    from tilefuse.bench.model import apply_variant, paged_cache

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
            sites[" <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}:{f.name}"
                              for f in frames[-6:][::-1])] += 1

    device = torch.device("cuda")
    subject = next(load() for name, load in hf_models.subjects(device, torch.bfloat16, args.layers, None, True)
                   if name == args.model)
    for variant in args.variants.split(","):
        model = subject.make()
        apply_variant(model, variant, None, {})
        prompt = torch.randint(0, subject.vocab, (args.batch, args.prompt), device=device)
        generate_eager(model, prompt, args.new, cache=paged_cache(model, prompt, args.new))     # warm-up
        torch.cuda.synchronize()
        sites.clear()
        shown, warnings.showwarning = warnings.showwarning, record
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate_eager(model, prompt, args.new, cache=paged_cache(model, prompt, args.new))
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = shown
        print(f"== {args.model} {variant}: {sum(sites.values())} synchronizing calls over {args.new} new tokens")
        for where, count in sites.most_common(12):
            print(f"{count:4d}  {where}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
