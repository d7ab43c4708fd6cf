"""``tilefuse.hf.generate`` against ``model.generate`` on a Llama-3-8B-shaped model (random bf16
weights, 8 blocks): ms per new token of each, the same greedy tokens, batch 1 and 16.

    python3 tools/generate_speed.py [OUT_DIR] [--layers 8] [--new 64]   # -> OUT_DIR/generate-<gpu>.json

Both decode ``--new`` tokens after a 128-token prompt (seeded random ids); each is run once untimed
(compiles, the capture) and then timed over three whole calls (wall clock around the call, a
synchronize after it: what a user sees, prefill included), ms per token = the median call's time
over the new tokens. The prefill alone (``model(prompt)``, the same way) is reported beside, so the
decode share can be read off. ``agreement`` is the fraction of equal new tokens (bf16: a near-tie
may flip a late token). Needs a CUDA GPU.
"""

from __future__ import annotations

import statistics
import sys
import time

from sweep_common import parse_args, sweep_path, write_json


def main() -> None:
    args = parse_args(__doc__, configs=False, workers=False,
                      **{"--layers": dict(type=int, default=8, help="decoder blocks (default 8)"),
                         "--new": dict(type=int, default=64, help="new tokens per call (default 64)")})
    import torch

    import tilefuse.hf
    from tilefuse.bench import hf_models

    device = torch.device("cuda")
    model = hf_models.random_model(hf_models.llama3_8b_config(args.layers), device, torch.bfloat16)
    rows = []
    for batch in (1, 16):
        torch.manual_seed(batch)
        ids = torch.randint(3, model.config.vocab_size, (batch, 128), device=device)
        mask = torch.ones_like(ids)

        def timed(fn):
            fn()                                   # compiles, capture
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times), out

        with torch.no_grad():
            prefill_ms, _ = timed(lambda: model(input_ids=ids, attention_mask=mask, logits_to_keep=1))
            stock_ms, stock = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                                           do_sample=False, eos_token_id=None, pad_token_id=0))
        ours_ms, ours = timed(lambda: tilefuse.hf.generate(model, ids, args.new, attention_mask=mask,
                                                           eos_token_id=None, pad_token_id=0))
        agree = (stock[:, 128:] == ours[:, 128:]).float().mean().item()
        row = dict(batch=batch, prompt=128, new_tokens=args.new, prefill_ms=round(prefill_ms, 3),
                   generate_ms=round(stock_ms, 3), tilefuse_generate_ms=round(ours_ms, 3),
                   generate_ms_per_token=round((stock_ms - prefill_ms) / (args.new - 1), 4),
                   tilefuse_ms_per_token=round((ours_ms - prefill_ms) / (args.new - 1), 4),
                   agreement=round(agree, 4))
        row["speedup_per_token"] = round(row["generate_ms_per_token"] / row["tilefuse_ms_per_token"], 3)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    write_json(sweep_path("generate", args.out_dir), rows, layers=args.layers,
               model="Llama-3-8B shapes, random bf16 weights")


if __name__ == "__main__":
    main()
