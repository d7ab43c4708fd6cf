"""Time Llama-3-8B's projections as the model calls them: tilefuse.nn.VQLinear against nn.Linear.

    python3 tools/vq_layer_probe.py [OUT_DIR]     # -> OUT_DIR/vq-llama3-layers-<gpu>.json

q/o (4096 x 4096), k/v (1024 x 4096), gate/up (14336 x 4096) and down (4096 x 14336), bf16, random
codes, x of shape [batch, 1, K] for batch 1 and 16 (one decode step), each module call timed as
CUDA-graph replays (cold L2) with ``tilefuse.bench.harness.Timer``; the variant the dispatch
picks is recorded beside the times. It locates where a model's decode step goes (docs/vq.md, end
to end). OUT_DIR defaults to ``bench/results/sweeps``. Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys

from sweep_common import parse_args, sweep_path

LAYERS = {"q": (4096, 4096), "k": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336)}


def main() -> None:
    args = parse_args(__doc__, workers=False, configs=False)

    import torch

    from tilefuse.bench.harness import Timer
    from tilefuse.bench.runner import machine_info
    from tilefuse.nn import VQLinear
    from tilefuse.ops.vq import op as vq_op

    torch.manual_seed(0)
    device = torch.device("cuda")
    timer = Timer(device, rep_ms=10)
    rows = []
    for name, (n, k) in LAYERS.items():
        dense = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        vq = VQLinear(k, n, bias=False, dtype=torch.bfloat16, device=device)
        vq.codes.copy_(torch.randint(-128, 128, vq.codes.shape, device=device, dtype=torch.int8))
        vq.codebooks.normal_(0, 0.5)
        for batch in (1, 16):
            x = torch.randn(batch, 1, k, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                dense_us = timer.graph_us(lambda: dense(x))
                vq_us = timer.graph_us(lambda: vq(x))
            rows.append(dict(layer=name, n=n, k=k, batch=batch, dense_us=round(dense_us, 1), vq_us=round(vq_us, 1),
                             variant=vq_op.choose_variant(batch, k, device, n)))
            print(rows[-1], flush=True)
    out = sweep_path("vq-llama3-layers", args.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(device), "rows": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
