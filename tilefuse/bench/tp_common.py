"""What the parts of ``tilefuse bench tp`` share: its run plan, rank-0 logging and the gather of
every rank's row. :mod:`tilefuse.bench.tp` (the driver) and :mod:`tilefuse.bench.tp_e2e` (the
end-to-end decode) both import it; it imports neither."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch.distributed as dist


def log(msg: str) -> None:
    """A progress line on stderr, from rank 0 only."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"[tp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    """What one ``bench tp`` run measures: the token counts, heads, contexts and batch of the
    per-layer cases, the timing's warm-up / repeat counts and eager budget (ms), and the
    end-to-end decode's blocks, batches, prompt and generated tokens."""
    mlp_tokens: tuple[int, ...]
    vq_tokens: tuple[int, ...]
    mla_heads: tuple[int, ...]
    mla_contexts: tuple[int, ...]
    mla_batch: int
    warmup: int
    reps: int
    eager_ms: float
    e2e_layers: int
    e2e_batches: tuple[int, ...]
    e2e_prompt: int
    e2e_tokens: int


def gather_rows(local: dict, world: int) -> list[dict]:
    """Every rank's dict (rank order); on one process just ``[local]``."""
    if world == 1:
        return [local]
    parts: list = [None] * world
    dist.all_gather_object(parts, local)
    return parts
