"""Time ``get_mla_metadata`` alone on the GPU: one CUDA-graph replay of the metadata kernel (cold
L2) on the benchmark's batches, the schedule it picked (slots or parts) and its split count. The
metadata runs once per decode step for all layers; ``bench mla`` sees it only as the difference
of its ``tilefuse+metadata`` and ``tilefuse`` rows, which the attention's noise blurs.

    python3 tools/mla_metadata_time.py [OUT.json]

Run it on two versions of ``tilefuse/ops/mla/kernels.py`` in one device call (swap the file in
between) to compare them on the same GPU. Writes ``mla-metadata-<gpu>.json`` in the current
folder by default. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from sweep_common import require_gpu


def batches() -> list[tuple[str, int, list[int]]]:
    from tilefuse.bench.mla import serving_mixes

    """(label, query rows per KV head, lengths): the benchmark's equal batches and serving mixes."""
    out = [(f"b{b} {n} each", rows, [n] * b) for b, rows, n in
           ((16, 16, 4096), (16, 128, 4096), (64, 16, 4096), (128, 16, 1024), (16, 16, 65536), (32, 32, 16384))]
    return out + [(f"b{b} h{h} s{s_q}: {label}", h * s_q, lens) for b, h, s_q, lens, label in serving_mixes()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=None, help="results file (default: mla-metadata-<gpu>.json)")
    args = ap.parse_args()
    require_gpu()
    import torch

    import tilefuse
    from tilefuse.bench.harness import Timer
    from tilefuse.ops.mla import op

    device = torch.device("cuda")
    timer = Timer(device, rep_ms=30.0)
    rows = []
    for label, q_rows, lens in batches():
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        parts = op.default_num_sm_parts(device, q_rows)
        call = lambda: tilefuse.get_mla_metadata(seqlens, q_rows, 1, num_sm_parts=parts)  # noqa: E731
        meta, splits = call()
        used = int(splits[-1])
        one_each = torch.arange(meta.shape[0], device=device).clamp_max(used).to(meta.dtype)
        samples = [timer.graph_us(call) for _ in range(3)]
        rows.append({"batch": label, "requests": len(lens), "parts": parts, "splits": used,
                     "schedule": "slots" if torch.equal(meta[:, 7], one_each) else "parts",
                     "us": round(statistics.median(samples), 2), "samples_us": [round(s, 2) for s in samples]})
        print(f"{label:50s} {rows[-1]['schedule']:5s} {used:4d} splits {rows[-1]['us']:7.2f} us", flush=True)
    gpu = torch.cuda.get_device_name(device)
    out = args.out or Path(f"mla-metadata-{gpu.split()[-1].lower()}.json")
    machine = {"gpu": gpu, "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
