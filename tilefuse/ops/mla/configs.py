"""Launch configurations of the MLA decode kernels: the measured settings and the dispatch rule.

Provenance: H200 sweeps of graph-replayed decode steps (the figures and the rule are in
``docs/mla.md``). ``TILEFUSE_CONFIGS``' ``"mla"`` section (``{key: config}`` plus an optional
``"small_rows_variant": {"short": ..., "long": ...}``) overrides them for tuning runs.

* ``"transposed"`` (ETAP): 17-63 query rows, BLOCK_H = next_pow2(rows) (16 or 32); BLOCK_N = 64
  (one page, M = 64 for WGMMA), 2 stages: 168 KB SMEM, one program per SM.
* ``"standard"``: >= 64 rows, 64-row head tiles (WGMMA M = 64), [64, 512] fp32 accumulator over
  8 warps; 221 KB SMEM (Q + 2 K stages).
* ``"wgmma"`` (Gluon, Hopper): the standard orientation with KV tiles of BLOCK_N tokens arriving
  by TMA into a ring of STAGES shared-memory buffers filled by a producer warp, and two 4-warp
  consumer warpgroups (``kernels_gluon.py``; ``num_warps`` = 4, the softmax warpgroup's); 64-row
  head tiles at any row count; Q + the ring + P take 226-230 KB of SMEM (BLOCK_N = 64 x 2 stages
  or 32 x 4), one program per SM; partials merged by the combine kernel.
* ``"standard_small"``: the standard orientation below 64 rows; BLOCK_H 0 = next_pow2(rows)
  (mma.sync, no padding), BLOCK_N = 32, 3 stages: 93 KB SMEM, two programs per SM.

``slot_programs``: programs per metadata slot (each takes an equal part of the slot's pages).
``fused_combine``: the last program of a request merges the partials, else a second launch does
(measured: the second launch is faster below 64 rows, where the fused merge is a serial tail in
one program; about even at 128 heads, kept fused). ``"<key>:long"`` / ``"<key>:short"`` entries,
where present, override ``"<key>"`` in that context regime.
"""

from __future__ import annotations

import bisect
import contextlib
import functools

from tilefuse import _env

CONFIGS = {
    "transposed": dict(BLOCK_N=64, num_warps=4, num_stages=2, slot_programs=1, fused_combine=False),
    "standard": dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, slot_programs=1, fused_combine=True),
    "standard_small": dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=3, slot_programs=2, fused_combine=False),
    "wgmma": dict(BLOCK_N=64, STAGES=2, FUSED_SPLITS=0, Q_AHEAD=False, PDL=1, SEESAW=0, num_warps=4, slot_programs=1,
                  fused_combine=False),
}
# The Gluon kernel's per-call levers (``"wgmma"`` above, kernels_gluon.mla_split_ws_kernel):
# * FUSED_SPLITS: requests of 2..FUSED_SPLITS splits are merged by the last of their splits to
#   finish (arrival counters in zeroed scratch) instead of the combine launch, which then merges
#   only longer ones; at or above the metadata's slot count no combine is launched (0: off);
# * Q_AHEAD: the next split's Q is issued under the current split's last tile;
# * SEESAW: 1: the two MMA warpgroups alternate tiles, each with its half of O, so one's softmax
#   runs under the other's MMAs (kernels_gluon._seesaw_wg; without FUSED_SPLITS, Q_AHEAD and PDL 2);
#   correct on the GPU tests, slower than the role split on all 16 lever batches (0.64-0.92x,
#   geomean 0.80x, H100; sweeps/mla-levers-seesaw-nvidia-h100-80gb-hbm3.json), off;
# * PDL: 1: the combine is a programmatic dependent launch (its programs start while the split
#   kernel's last ones run, then wait for its end); 2: the split kernel too, after whatever precedes it.
# Measured each alone against the plain path in one process on an H100 (tools/mla_wgmma_t_ab.py
# --cases levers, graph replay, bench/results/sweeps/mla-levers-nvidia-h100-80gb-hbm3.json): PDL 1
# is the only one that pays (1.003-1.035x on 13 of 16 batches, most at 1-4 requests of 1K-4K
# tokens; level on the rest), so it is on; the fused combine is slower on every batch with
# FUSED_SPLITS 16 (0.36-0.996x: one warpgroup merging a (request, head tile)'s partials is bound by
# L2 latency, 64 rows x 16 splits cost more than the launch it saves), Q ahead is level
# (0.99-1.01), PDL 2 no better than 1.
WGMMA_LEVERS = ("FUSED_SPLITS", "Q_AHEAD", "PDL", "SEESAW")
SHIPPED_LEVERS = {lever: CONFIGS["wgmma"][lever] for lever in WGMMA_LEVERS}   # for overrides that omit them
# The combine launch (kernels.mla_combine_kernel, after every kernel that leaves partials): a
# program per (request, query row, COL_BLOCKS-th of the 512 columns) reads S_CHUNK partials per
# load in two passes (the largest lse, then the weighted sum): 2 ceil(n / S_CHUNK) dependent L2
# round trips for a request of n partials. combine_settings picks from shapes (no host sync):
# * S_CHUNK: 32 where the schedule gives a request 12 or more parts on average (few long requests:
#   a quarter of the round trips), else 8 (most requests of one or a few partials: a [32, 512]
#   load would be mostly masked, 128 registers a thread);
# * COL_BLOCKS: 1 (a quarter of the columns per program: slower with 32 partials per load on 7 of
#   the 8 batches where both were timed, level on the 8th; with 8, slower on 18 of 20);
# * ROWS (query rows per program, merged one after the other): 1. More is the candidate for large
#   batches of one-split requests, whose programs only read two split counts and end (16384 of
#   them at b128 h128, where the combine ends ~11 us after the split kernel and FlashMLA main's
#   takes 3.2 us; sweeps/mla-kernel-times-h100-80gb-hbm3.json); not yet run on a GPU, off
#   (wgmma_levers(COMBINE_ROWS=4); tools/mla_wgmma_t_ab.py --candidates combine_rows4).
# Measured on an H100 in one process (tools/mla_wgmma_t_ab.py --cases levers, graph replay,
# bench/results/sweeps/mla-levers-combine-nvidia-h100-80gb-hbm3.json, 20 batches): 32 partials
# over all the columns 1.03-1.24x against 8 on all 10 batches of 16.5-132 parts a request,
# 0.82-1.01x on the 10 of 0.8-8.2 (0.82-0.90 at 128 heads, 2-4 parts), where the rule keeps 8; 32 partials
# over a quarter of the columns (the first rule's pick at up to 132 programs) 0.90-1.00x against
# 32 over all of them. The threshold was set on those 20 batches (none of 9-15 parts measured).
# ``None``: by the rule; a number (wgmma_levers' COMBINE_S_CHUNK / COMBINE_COL_BLOCKS /
# COMBINE_ROWS) pins it.
COMBINE = dict(S_CHUNK=None, COL_BLOCKS=None, ROWS=None)


def combine_settings(batch: int, num_parts: int) -> tuple[int, int, int]:
    """(S_CHUNK, COL_BLOCKS, ROWS) of the combine launch for ``batch`` requests scheduled over
    ``num_parts`` parts: the rule above, each setting pinned by :data:`COMBINE` where set."""
    return (COMBINE["S_CHUNK"] or (32 if num_parts >= 12 * batch else 8), COMBINE["COL_BLOCKS"] or 1,
            COMBINE["ROWS"] or 1)


levers_version = 0      # bumped by wgmma_levers: the op's call plans include it


@contextlib.contextmanager
def wgmma_levers(**levers):
    """Run the block with the Gluon kernel's levers (:data:`WGMMA_LEVERS`) and the combine's
    settings (``COMBINE_<key>`` for a key of :data:`COMBINE`) set, e.g. ``with
    wgmma_levers(FUSED_SPLITS=16, PDL=1): ...`` (tests, same-run A/Bs); restored after. Calls plan
    again inside and after it (no cached plan or launch config outlives a change)."""
    global levers_version
    combine = {k[len("COMBINE_"):]: levers.pop(k) for k in list(levers) if k.startswith("COMBINE_")}
    unknown = (set(levers) - set(WGMMA_LEVERS)) | {f"COMBINE_{k}" for k in set(combine) - set(COMBINE)}
    if unknown:
        raise ValueError(f"levers: expected names from {WGMMA_LEVERS} or COMBINE_ + {tuple(COMBINE)}, got "
                         f"{sorted(unknown)}")
    if levers.get("SEESAW") and (levers.get("FUSED_SPLITS") or levers.get("Q_AHEAD") or levers.get("PDL", 0) >= 2):
        raise ValueError(f"levers: SEESAW goes without FUSED_SPLITS, Q_AHEAD and PDL 2, got {levers}")
    if combine.get("COL_BLOCKS", 1) not in (None, 1, 2, 4, 8) or combine.get("ROWS", 1) not in (None, 1, 2, 4, 8) \
            or combine.get("S_CHUNK", 8) not in (None, 2, 4, 8, 16, 32, 64):
        raise ValueError(f"levers: expected COMBINE_COL_BLOCKS and COMBINE_ROWS in 1, 2, 4, 8 and COMBINE_S_CHUNK "
                         f"a power of two 2-64 (None: by combine_settings), got {combine}")
    saved, saved_combine = dict(CONFIGS["wgmma"]), dict(COMBINE)
    CONFIGS["wgmma"] = {**saved, **levers}
    COMBINE.update(combine)
    levers_version += 1
    launch_config.cache_clear()
    try:
        yield
    finally:
        CONFIGS["wgmma"] = saved
        COMBINE.clear()
        COMBINE.update(saved_combine)
        levers_version += 1
        launch_config.cache_clear()
GLUON_VARIANTS = ("wgmma",)     # the Gluon kernel (Hopper, 16-bit q)
# Orientation at <= 16 query rows, per context regime. The regime comes from a shape (the block
# table's width, an upper bound on the context), so it costs no host sync and is fixed in a CUDA
# graph. Measured (the tl kernels' full grid, folded into bench/results/mla-h200-quick.json as
# "mla-h200"): the unpadded standard kernel is up to 15 % faster in both regimes except batch 16 at
# 1K (10 % slower); at 17-63 rows the transposed kernel wins everywhere (the standard one is
# 10-26 % slower).
LONG_CONTEXT_PAGES = 256
# The Gluon kernel wins at every row count measured on the H200 (bench/results/mla-h200-quick.json:
# 16 rows 40.5 vs 41.3 us at b16 4K, 340 vs 342 us at 64K; 32 rows 174 vs 310 us; at 128 rows the
# tl kernels of its folded "mla-h200" run take 1.8-2.1x its time), so on Hopper it takes every
# shape; the tl rule below serves elsewhere.
WGMMA_FROM_ROWS = 1
# The Gluon dense FP8 kernel (kernels_gluon_fp8.py: bf16 q, FP8 cache, Hopper) by query rows per
# KV head: BLOCK_H rows per program (transposed products, nothing padded); up to
# FP8_GLUON_MAX_ROWS rows, past 32 as head tiles of 32 (each streaming its part's pages); above,
# the tl kernels. Two forms:
# * serial (CONVERTERS 0): STAGES ring slots of 64 tokens (41 KB each), one 64 KB K tile that the
#   num_warps consumer warps convert and multiply in turn;
# * warp-specialized (CONVERTERS > 0, kernels_gluon_fp8_ws.py): STAGES ring slots of SLOT_N tokens
#   (SLOT_N x 656 B), CONVERTERS warps filling two 72 KB K buffers, one MMA warpgroup (num_warps 4;
#   MMA_AHEAD: the next tile's S^T issued behind P V): Q (BLOCK_H x 1152 B) + 144 KB + ring + P^T
#   within 227 KB (16 rows: 3 slots of 32 tokens; 32: 2). SKIP is for timing only (results wrong).
# Measured on the H100 (bench/results/sweeps/mla-fp8-ws-nvidia-h100-80gb-hbm3.json, one run): the
# warp-specialized form with 8 converter warps is the fastest on every case at 8-64 rows, 1.20-1.31x
# the serial form; 4 converter warps 2-7 % slower, MMA_AHEAD 2-13 % slower (an earlier run: slots of
# 16 tokens 13-26 % slower than slots of 32). 8 converter warps need slots of >= 32 tokens.
FP8_GLUON_SERIAL = {
    16: dict(BLOCK_H=16, STAGES=2, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=0, num_warps=8),
    32: dict(BLOCK_H=32, STAGES=2, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=0, num_warps=8),
}
FP8_GLUON_WS = {
    16: dict(BLOCK_H=16, STAGES=3, SLOT_N=32, CONVERTERS=8, MMA_AHEAD=0, SKIP=0, RS=0, num_warps=4),
    32: dict(BLOCK_H=32, STAGES=2, SLOT_N=32, CONVERTERS=8, MMA_AHEAD=0, SKIP=0, RS=0, num_warps=4),
}
# * register-operand (RS 1, kernels_gluon_fp8_rs.py): STAGES ring slots of 64 tokens (41 KB), no
#   16-bit K tile: the MMA warpgroup converts the codes into the WGMMAs' register operands. An
#   option, not the default: 1.5-2.2x the warp-specialized form's time at 16-32 rows on the H100
#   (bench/results/sweeps/mla-fp8-rs-nvidia-h100-80gb-hbm3.json; 258 against 175 us at b32 h16 16K).
FP8_GLUON_RS = {
    16: dict(BLOCK_H=16, STAGES=4, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=1, num_warps=4),
    32: dict(BLOCK_H=32, STAGES=4, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=1, num_warps=4),
}
# RS 2: two MMA warpgroups taking every other tile, each with its own softmax state, merged at
# the end of each split (Q, 4 P_g^T each and the exchange within 227 KB: 3 slots at 16 rows, 2 at 32)
FP8_GLUON_RS2 = {
    16: dict(BLOCK_H=16, STAGES=3, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=2, num_warps=4),
    32: dict(BLOCK_H=32, STAGES=2, SLOT_N=64, CONVERTERS=0, MMA_AHEAD=0, SKIP=0, RS=2, num_warps=4),
}
FP8_GLUON_CONFIGS = {rows: dict(cfg) for rows, cfg in FP8_GLUON_WS.items()}
# Two 32-row head tiles of the warp-specialized form beat the tl standard kernel's 64-row tile on
# the H100 (same file: 366 against 437 us at 48 rows, b64 h16 s3 8K; 366 against 387 at 64, b32
# h32 s2 16K); above 64 rows (not measured with this form) the tl kernel serves.
FP8_GLUON_MAX_ROWS = 64
# The Gluon dense FP8 kernel's 64-row head tiles (kernels_gluon_fp8_wide.py: the 16-bit kernel's
# softmax and PV warpgroups, a converter warpgroup turning the 656-byte rows into fp16 K slots;
# bf16 q, Hopper) from FP8_WIDE_FROM_ROWS query rows per KV head, the transposed forms below.
# Measured on the H100 (tools/mla_fp8_sweep.py --cases a47, graph replay, one run:
# bench/results/sweeps/mla-fp8-wide-nvidia-h100-80gb-hbm3.json): 380-387 against 677-682 us of the
# warp-specialized 32-row tiles and 675-695 of the tl kernel at 128 rows (b16 h128 32K, b64 h128
# 8K), 360 against 659 (held-out b24 h64 s_q 2 uneven), 273 against 496 (held-out b32 h128
# uneven); 211 against 368 at 64 rows (b32 h32 s_q 2); at 16-32 rows the transposed form stays
# ahead (174 / 197 against 206 / 207). Registers per thread: the PV warpgroup PV_REGS, the
# converter CONVERTER_REGS, the softmax warpgroup the rest of 504 (168 / 120 / 216: the split with
# the fewest spills on sm_90, 32 bytes; 160 for PV spills 200+); PREFETCH: the converter asks L2
# for the rows of the tile this many ahead (1: 4-10 % faster than 0, 2 between); PIPELINE: 1 loads
# the next tile group by group under the current one's conversion (not yet measured); SKIP: stages
# left out, for timing only.
FP8_WIDE_FROM_ROWS = 33
FP8_GLUON_WIDE = dict(BLOCK_N=64, STAGES=2, PDL=1, PV_REGS=168, CONVERTER_REGS=120, PREFETCH=1, SKIP=0,
                      PIPELINE=0, num_warps=4)
# Above 32 rows, where the Gluon FP8 kernel does not serve (fp16 q, other GPUs, past
# FP8_GLUON_MAX_ROWS), a dense FP8 decode takes the tl standard kernel's 64-row tile rather than
# the transposed kernel, which dequantizes every page once per 32-row head tile: at 48 rows 431
# against 973 us on the H200, bench/results/sweeps/mla-fp8-h200.json.
FP8_TRANSPOSED_MAX_ROWS = 32
# The Gluon 16-bit kernel's transposed form (kernels_gluon_t.py: cached tokens as WGMMA's M, the
# query rows as N, one MMA warpgroup, a producer warp filling two 72 KB K buffers by TMA) for
# s_q * h_q up to TRANSPOSED_GLUON_MAX_ROWS where the Gluon kernel runs (0: never; the 64-row
# head tiles of kernels_gluon.py serve every row count). Its tiles: BLOCK_H 16 or 32 rows. The
# "wgmma_t_max_rows" key of TILEFUSE_CONFIGS' "mla" section sets it for a run.
# Measured on an H200 against the 64-row tiles (tools/mla_wgmma_t_ab.py, graph replay, the
# benchmark's <= 32-row cases and 10 held-out batches; bench/results/sweeps/mla-wgmma-t-nvidia-h200.json):
# slower in 16 of 17 (0.84-0.985x their speed, geomean 0.937; level at 2 rows), so it stays off;
# kept for chips whose ridge point is below the padded tile's (the H20: not measured).
TRANSPOSED_GLUON_MAX_ROWS = 0
TRANSPOSED_GLUON_CONFIGS = {
    16: dict(BLOCK_H=16, BLOCK_N=64, STAGES=2, num_warps=4),
    32: dict(BLOCK_H=32, BLOCK_N=64, STAGES=2, num_warps=4),
}


def transposed_gluon_config(rows: int) -> dict:
    """The transposed Gluon kernel's launch for ``1 <= rows <= 32`` query rows per KV head: the
    smallest tile of :data:`TRANSPOSED_GLUON_CONFIGS` that holds them."""
    tiles = [b for b in TRANSPOSED_GLUON_CONFIGS if rows <= b]
    if rows < 1 or not tiles:
        raise ValueError(f"rows: the transposed Gluon kernel takes 1-{max(TRANSPOSED_GLUON_CONFIGS)} query rows, "
                         f"got {rows}")
    return dict(TRANSPOSED_GLUON_CONFIGS[min(tiles)])


def transposed_gluon(rows: int, fp8: bool = False) -> bool:
    """A 16-bit cache's decode of ``rows`` query rows, where the Gluon kernel was chosen, runs its
    transposed form (:data:`TRANSPOSED_GLUON_MAX_ROWS`, within its largest tile)."""
    return not fp8 and 1 <= rows <= min(TRANSPOSED_GLUON_MAX_ROWS, max(TRANSPOSED_GLUON_CONFIGS))


def fp8_gluon_config(rows: int) -> dict:
    """The Gluon dense FP8 kernel's launch for ``rows = s_q * h_q <= FP8_GLUON_MAX_ROWS`` query
    rows per KV head: the smallest tile of :data:`FP8_GLUON_CONFIGS` that holds them, or head tiles
    of the largest one (``ceil(rows / BLOCK_H)`` programs per part, each streaming the part's pages)."""
    if not 1 <= rows <= FP8_GLUON_MAX_ROWS:
        raise ValueError(f"rows: the Gluon FP8 kernel takes 1-{FP8_GLUON_MAX_ROWS} query rows, got {rows}")
    return dict(FP8_GLUON_CONFIGS[min((b for b in FP8_GLUON_CONFIGS if rows <= b), default=max(FP8_GLUON_CONFIGS))])


# Two schedules; the metadata kernel picks one per batch (the cost model below).
#
# Slots (one program per split, handed to SMs as they free): every request cut in even splits of
# at most one chunk, the chunk that minimizes the expected busiest SM (schedule_cost). The fixed
# cost of one split, in 64-token pages of KV at one SM's share of the bandwidth: its query tile,
# the pipeline's fill, a partial the combine reads back. Measured (tools/mla_split_cost_sweep.py,
# H200, bench/results/sweeps/mla-split-cost-h200.json): the schedules that 6-8 pick are within
# 1.2-1.4 % of each serving mix's best (geomean), those of 4 within 5.6 %.
SPLIT_COST_PAGES = 8
# Parts (one program per part, running its splits back to back; FlashMLA's schedule): the batch's
# work, pages plus PART_SPLIT_COST_PAGES per request, laid on one line and cut into equal parts;
# the next split's tiles load while the last one's output is written, so no pipeline fill is
# counted (FlashMLA's scheduler counts 5 blocks per split).
PART_SPLIT_COST_PAGES = 5
# The parts schedule runs where its busiest part (the share plus a split cost) is at most
# PART_GAIN of the slot schedule's expected busiest part and that is at least PART_MIN_PAGES:
# measured on the H200 (bench/results/sweeps/mla-persistent-c5-h200.json against
# mla-h200-quick.json), the persistent programs cost a few microseconds more per launch and some
# per page at 128 heads, so they pay only where they balance long, uneven batches (one 128K
# request among 255 short ones: 194 -> 158 us; 96 requests of 1-20000 tokens and one of 70000:
# 355 -> 314 us) and lose on short or evenly split ones (128 x 1K tokens: 60 -> 70 us).
# Measured again (tools/mla_schedule_sim.py --random 1000 --write, then
# tools/mla_split_cost_sweep.py --mixes and on the benchmark's mixes; bench/results/sweeps/
# mla-schedule-pick-h200.json), both schedules forced: on random uneven batches parts ran 1.04-1.34x
# faster than slots in 33 of 34 (equal in the other), 1.08-1.18x on the 13 that the old 0.85 kept
# on slots (uniform and two-mode batches of 8-512 requests up to 128K tokens, 16 and 128 heads),
# whose estimates flip to parts at 0.86-0.90; on equal lengths (flipping at 0.97-1.0) slots ran
# 0.94-1.02x parts' time (b64 x 4K at 128 heads: 160 against 170 us). 0.92 lies between.
PART_GAIN = 0.92
PART_MIN_PAGES = 64
# The metadata has SLOT_WAVES * num_sm_parts + b rows: up to SLOT_WAVES splits per part (plus one
# per request), so a batch that one wave cannot balance is cut finer. SCHEDULE_CANDIDATES chunk
# sizes are tried besides the one-wave chunk: 1.5x, 1x, 3/4, 1/2, 3/8, 1/4, 3/16, 1/8 of the
# balanced share.
SLOT_WAVES = 4
SCHEDULE_CANDIDATES = 8


def schedule_cost(total_pages: int, slots: int, chunk: int, parts: int) -> float:
    """Expected pages of the busiest part when ``slots`` splits of at most ``chunk`` pages
    (``total_pages`` in all) run on ``parts`` parts, each split costing SPLIT_COST_PAGES more.

    One wave (``slots <= parts``): the longest split, ``chunk + cost``. More: the programs of a
    launch are handed to SMs as they free, which is list scheduling, bounded below by the mean
    ``(total + cost slots) / parts`` and above by the mean plus one split; the estimate is the
    middle of the two. On the benchmark's serving mixes it is within 14 % of a simulation of that
    hand-out, never below it (``tools/mla_schedule_sim.py``); on random long multi-wave mixes it
    can fall up to ~20 % below (``--random``; docs/mla.md says what that costs the pick). The
    metadata kernel computes it in integers (``_schedule_cost2``: twice this, rounded up)."""
    longest = chunk + SPLIT_COST_PAGES
    if slots <= parts:
        return float(longest)
    return max(float(longest), (total_pages + SPLIT_COST_PAGES * slots) / parts + longest / 2)


def parts_cost(pages: list[int], parts: int) -> float:
    """The parts schedule's busiest part as the cost model counts it: the share of the line plus
    one split cost (a part that begins inside a request pays for that split too)."""
    total = max(sum(p + PART_SPLIT_COST_PAGES for p in pages), 1)
    return total / min(parts, total) + PART_SPLIT_COST_PAGES


def schedule_splits(pages: list[int], parts: int, cost: int = PART_SPLIT_COST_PAGES) -> list[list[tuple]]:
    """The parts schedule in plain Python (``kernels.mla_metadata_kernel`` computes it on the
    device, ``op._metadata_torch`` in PyTorch): for each part, the splits it runs as (request,
    first page, end page). Requests of ``pages`` pages lie end to end on a line, each after
    ``cost`` units of fixed cost; the line is cut into ``min(parts, total)`` equal parts. A cut
    inside a request's pages splits it there; a split belongs to the part where its pages begin
    (a request without pages: the part of its last unit of fixed cost). For tests and tools."""
    total = max(sum(p + cost for p in pages), 1)
    n = min(parts, total)
    cuts = [p * total // n for p in range(n + 1)]
    runs: list[list[tuple]] = [[] for _ in range(parts)]
    pos = 0
    for req, pg in enumerate(pages):
        a, e = pos + cost, pos + cost + pg
        inner = [c - a for c in cuts[1:n] if a < c < e]
        bounds = [0, *inner, pg]
        for k in range(len(bounds) - 1):
            start = a + bounds[k] if pg else e - 1
            part = min(bisect.bisect_right(cuts, start) - 1, n - 1)
            runs[part].append((req, bounds[k], bounds[k + 1]))
        pos = e
    return runs


def part_loads(pages: list[int], parts: int, cost: int = PART_SPLIT_COST_PAGES) -> list[int]:
    """Each part's work in pages under :func:`schedule_splits`, every split counted ``cost`` pages more."""
    return [sum(end - begin + cost for _, begin, end in run) for run in schedule_splits(pages, parts, cost)]


# The dense FP8 decode (FlashMLA's 656-byte layout) on its kernels (Gluon on Hopper up to
# FP8_GLUON_MAX_ROWS rows for a bf16 q, the tl split kernels, which dequantize each tile as they
# load it, elsewhere), and the sparse decode on its gather kernels (Gluon for an FP8 cache on
# Hopper, tl elsewhere): on wherever the tl kernels run (the Triton backend, a 16-bit q); off, the
# PyTorch references decode (a switch for debugging). Measured on the H200 against FlashMLA and
# the bf16 path in the FP8 cases of bench/results/mla-h200-quick.json.
FP8_SPARSE_KERNELS = True


# The sparse (top-k) decode's launch, by heads per KV head: heads per tile, tokens per step, warps,
# pipeline stages, how many programs per SM the index lists are cut into (each part a partial of
# the same softmax), and fit_regs: where the grid holds more than two programs per SM, the
# registers per thread are capped at this so that three fit an SM at once (255 registers fit two;
# the gather is latency-bound, so occupancy is what pays: 313 -> 216 us at batch 128, 16 heads),
# while a grid of two per SM keeps the uncapped kernel (the cap's spills cost 10 % there).
# Read by op._sparse_decode; measured by tools/mla_sparse_sweep.py
# (bench/results/sweeps/mla-sparse-h200.json).
SPARSE_CONFIGS = {
    16: dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2, waves=2, fit_regs=168),
    128: dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2, waves=2, fit_regs=None),
}


# The Gluon sparse kernel (kernels_gluon_sparse.py: FP8 caches on Hopper; cp.async ring of gathered
# rows, transposed WGMMAs): heads per tile (WGMMA's N), ring slots, warps (8: two warpgroups, each
# half of the tile's heads), by heads per KV head. Its shared memory (Q, the index list, STAGES raw
# 41 KB slots, the 72 KB 16-bit K tile) allows one program per SM: 3 slots fit with 8-16 heads per
# tile, 2 with 32. More heads run as several tiles, each gathering the same rows. Measured by
# tools/mla_sparse_sweep.py (bench/results/sweeps/mla-sparse-h200.json): 8 warps gain 12-15 % with
# 32-head tiles and nothing with 16; 16-head tiles of 64-128 heads lose 50-70 % (each tile re-gathers).
GLUON_SPARSE_CONFIGS = {
    8: dict(kernel="gluon", BLOCK_H=8, STAGES=2, num_warps=4),
    16: dict(kernel="gluon", BLOCK_H=16, STAGES=3, num_warps=4),
    128: dict(kernel="gluon", BLOCK_H=32, STAGES=2, num_warps=8),
}
# heads per KV head up to which an FP8 cache takes the Gluon kernel (above: the tl one)
GLUON_SPARSE_MAX_HEADS = 128
# The sparse decode on Hopper (bf16 q) has two paths, picked per call by a cost model in ns per
# index-list position of one query token (``positions`` = query tokens x topk, both lists):
# * the Gluon sparse kernel gathers and dequantizes each position's 656 bytes once per head tile
#   (8-32 heads), so its time grows with the tiles: SPARSE_GLUON_TILE_NS x tiles x positions +
#   SPARSE_GLUON_FIXED_US;
# * gather + dense (op._sparse_gather_dense): the selected tokens copied once into a dense bf16
#   cache (656 bytes read + 1152 written per position) and the Gluon dense kernel on it, 64 heads
#   per tile with both products on WGMMA: (SPARSE_GATHER_NS + SPARSE_DENSE_TILE_NS x 64-head
#   tiles) x positions + SPARSE_GATHER_DENSE_FIXED_US (the gather launch, the metadata kernel, the
#   dense kernel's fill and combine).
# Fitted on the H200 to both paths pinned side by side (bench/results/mla-h200-quick-sparse.json,
# tilefuse:sparse-gluon and tilefuse:gather-dense): at 64 and 128 heads, batch 16 and 128, s_q 1
# and 2 within 3 % of the fit; at 16-32 heads (16-head tiles run below it) and on a 48-head mix of
# shorter lists within 17 %; the pick is the faster path in all 22 cases. Gather + dense runs only
# where predicted at most SPARSE_GATHER_DENSE_GAIN of the sparse kernel's time: 128 heads from
# about 28K positions (14 query tokens at topk 2048), 33-64 heads from about 196K (96), never at
# <= 32 heads (one tile).
SPARSE_GLUON_TILE_NS = 0.55
SPARSE_GLUON_FIXED_US = 15.0
SPARSE_GATHER_NS = 0.60
SPARSE_DENSE_TILE_NS = 0.27
SPARSE_GATHER_DENSE_FIXED_US = 37.0
SPARSE_GATHER_DENSE_GAIN = 0.9
# Eager calls (not captured in a CUDA graph) cost at least the host's time to issue them: gather +
# dense issues the gather, the metadata kernel, the plan and the dense kernel with its combine
# (eager_us 147-194 at batch 16 in mla-h200-quick-sparse.json, where its GPU time is 65-110), the
# sparse kernel one launch and its combine (70-86). Each path's estimate is at least its floor.
SPARSE_GATHER_DENSE_EAGER_US = 150.0
SPARSE_GLUON_EAGER_US = 85.0
# None: the cost model picks; True / False: gather + dense wherever it can run / never (tests, the
# benchmark's side by side)
SPARSE_GATHER_DENSE: bool | None = None


def sparse_gather_dense_pays(h_q: int, positions: int, eager: bool = False) -> bool:
    """Whether gather + dense is predicted at most ``SPARSE_GATHER_DENSE_GAIN`` of the Gluon
    sparse kernel's time for ``h_q`` heads per KV head over ``positions`` index-list positions
    (query tokens x topk, both lists) -- the cost model above, with each path's host floor for an
    ``eager`` call -- unless ``SPARSE_GATHER_DENSE`` decides."""
    if SPARSE_GATHER_DENSE is not None:
        return SPARSE_GATHER_DENSE
    tiles = -(-h_q // sparse_config(h_q, gluon=True)["BLOCK_H"])
    sparse_us = SPARSE_GLUON_TILE_NS * tiles * positions / 1e3 + SPARSE_GLUON_FIXED_US
    per_position_ns = SPARSE_GATHER_NS + SPARSE_DENSE_TILE_NS * -(-h_q // 64)
    dense_us = per_position_ns * positions / 1e3 + SPARSE_GATHER_DENSE_FIXED_US
    if eager:
        sparse_us, dense_us = max(sparse_us, SPARSE_GLUON_EAGER_US), max(dense_us, SPARSE_GATHER_DENSE_EAGER_US)
    return dense_us <= SPARSE_GATHER_DENSE_GAIN * sparse_us


# The gather's programs per SM (each a run of index-list positions, BLOCK_T per step: enough
# rows in flight per SM to cover HBM latency), and the most bytes of dense cache one group of
# query tokens takes (more query tokens run in groups, one dense decode each).
SPARSE_GATHER_PROGRAMS_PER_SM = 4
SPARSE_GATHER_BLOCK_T = 32
SPARSE_GATHER_MAX_BYTES = 1 << 30
# a part's index list is copied into SMEM whole (a power-of-two number of 64-entry tiles): at most
# this many bytes (2048 int32 indices), which fits beside 3 ring slots and a 16-head Q
GLUON_SPARSE_INDEX_BYTES = 8192
# A part's fixed cost in tiles of 64 gathered tokens: its ring's prologue (the first tile's copy
# waited for), its Q load, its partial's write and the combine's read of it.
GLUON_SPARSE_PART_COST_TILES = 2


@functools.lru_cache(maxsize=1024)
def gluon_sparse_part_tiles(tiles: int, programs_per_part: int, slots: int, max_tiles: int) -> int:
    """Tiles of 64 index-list positions per part (program) of the Gluon sparse kernel, for lists of
    ``tiles`` tiles, ``programs_per_part`` programs for each part index (query tokens x head tiles)
    and ``slots`` programs running at once (one per SM): the count that minimizes the busiest SM's
    work, whole waves of programs x (tiles per part + the part's fixed cost); a tie takes longer
    parts (fewer partials). Waves, not an average, because one program per SM runs a part start to
    end: 160 parts of 7 tiles on 132 SMs take two rounds, 128 of 8 one."""
    best_cost, best = None, 1
    for per in range(1, max(1, min(tiles, max_tiles)) + 1):
        parts = -(-tiles // per)
        cost = -(-programs_per_part * parts // slots) * (per + GLUON_SPARSE_PART_COST_TILES)
        if best_cost is None or cost <= best_cost:
            best_cost, best = cost, per
    return best


def sparse_config(h_q: int, gluon: bool = False) -> dict:
    """The sparse decode's launch for ``h_q`` heads per KV head: with ``gluon`` (an FP8 cache on a
    Hopper GPU with Gluon) and ``h_q <= GLUON_SPARSE_MAX_HEADS``, :data:`GLUON_SPARSE_CONFIGS`'s,
    else :data:`SPARSE_CONFIGS`'s (``kernel="tl"``), the entry of the smallest head bound >= h_q."""
    table = GLUON_SPARSE_CONFIGS if gluon and h_q <= GLUON_SPARSE_MAX_HEADS else SPARSE_CONFIGS
    cfg = dict(table[min(bound for bound in table if bound >= h_q)])
    cfg.setdefault("kernel", "tl")
    return cfg


SMALL_ROWS_VARIANT = {"short": "standard", "long": "standard"}

_overrides = dict(_env.settings.configs.get("mla", {}))
SMALL_ROWS_VARIANT.update(_overrides.pop("small_rows_variant", {}))
TRANSPOSED_GLUON_MAX_ROWS = int(_overrides.pop("wgmma_t_max_rows", TRANSPOSED_GLUON_MAX_ROWS))
CONFIGS.update(_overrides)


def regime(max_blocks: int) -> str:
    """"long" if the block table has room for >= LONG_CONTEXT_PAGES pages per request, else "short"."""
    return "long" if max_blocks >= LONG_CONTEXT_PAGES else "short"


# Padding the query rows to 64 (the WGMMA kernel's head tile) multiplies the work by 64 / rows:
# 64 rows do 64 x 2 x (576 + 512) FLOP per 1152-byte cached token, 121 FLOP/B. A chip whose
# ridge point (dense bf16 FLOP/s over HBM bytes/s) is below that turns the padded kernel
# compute-bound below 64 rows, and the transposed (ETAP) kernel, which pads nothing, wins there:
# the H20 (about 40 FLOP/B). The rates are the dispatch's chip table (``_dispatch.CHIPS``: the
# H200's measured, other parts scaled from their datasheets; an unknown part as the H200).
PADDED_FLOP_PER_BYTE = 64 * 2 * (576 + 512) / (576 * 2)


def ridge(device_name: str) -> float:
    """Dense bf16 FLOP per HBM byte at which the chip ``device_name`` turns compute-bound."""
    from tilefuse import _dispatch

    chip = _dispatch.chip_of(device_name, _dispatch.CHIPS["H200"].sms)   # the ratio is the same at any SM count
    return chip.bf16_flop_per_us / chip.copy_bytes_per_us


def default_variant(rows: int, max_blocks: int, wgmma: bool = False, chip_ridge: float | None = None) -> str:
    """With ``wgmma`` (the Gluon kernel runs here: Hopper, 16-bit q): the Gluon kernel from
    WGMMA_FROM_ROWS query rows, and below 64 rows only where padding to 64 rows keeps it
    memory-bound (``chip_ridge`` >= PADDED_FLOP_PER_BYTE). Otherwise the tl kernels: standard (64-row
    head tiles) from 64 query rows; below, transposed (ETAP), except at <= 16 rows where
    SMALL_ROWS_VARIANT picks per regime (on a low-ridge chip: transposed)."""
    low_ridge = chip_ridge is not None and chip_ridge < PADDED_FLOP_PER_BYTE
    if wgmma and rows >= WGMMA_FROM_ROWS and (rows >= 64 or not low_ridge):
        return "wgmma"
    if rows >= 64:
        return "standard"
    if low_ridge:
        return "transposed"
    return SMALL_ROWS_VARIANT[regime(max_blocks)] if rows <= 16 else "transposed"


@functools.lru_cache(maxsize=1024)
def launch_config(variant: str, rows: int, max_blocks: int, elem_bytes: int = 2) -> tuple[dict, bool, int, tuple]:
    """(kernel meta-parameters, fused combine, programs per slot, a hashable key of all three) for
    ``rows = s_q * h_q`` query rows of ``elem_bytes``-byte q and cache elements; cached per shape
    (tuning code that edits ``CONFIGS`` calls ``launch_config.cache_clear()``)."""
    if variant == "wgmma_fp8":       # the Gluon FP8 kernel: head tiles of <= 32 rows; one program per part
        cfg = fp8_gluon_config(rows)
        return cfg, False, 1, (tuple(sorted(cfg.items())), False, 1)
    if variant == "wgmma_fp8_wide":  # the Gluon FP8 kernel's 64-row tiles; one program per part
        cfg = dict(FP8_GLUON_WIDE)
        return cfg, False, 1, (tuple(sorted(cfg.items())), False, 1)
    if variant == "wgmma_t":         # the Gluon 16-bit kernel's transposed form: one head tile of <= 32 rows
        cfg = transposed_gluon_config(rows)
        return cfg, False, 1, (tuple(sorted(cfg.items())), False, 1)
    key = "standard_small" if variant == "standard" and rows < 64 else variant
    cfg = dict(CONFIGS.get(f"{key}:{regime(max_blocks)}", CONFIGS[key]))
    fused = cfg.pop("fused_combine", True)
    per_slot = cfg.pop("slot_programs", 1)
    if variant in GLUON_VARIANTS:    # 64-row head tiles whatever the row count; one program per part
        for lever, shipped in SHIPPED_LEVERS.items():
            cfg.setdefault(lever, shipped)
        # a head tile's rows that can be valid (the fused combine's chunks; one compile when off)
        cfg["MERGE_ROWS"] = min(64, max(16, _next_pow2(rows))) if cfg["FUSED_SPLITS"] else 64
        return cfg, False, 1, (tuple(sorted(cfg.items())), False, 1)
    block_h = max(16, _next_pow2(min(rows, 64)))
    if variant != "transposed":
        block_h = cfg.pop("BLOCK_H", 0) or block_h
    else:
        cfg.pop("BLOCK_H", None)
    if block_h > 16:
        cfg["num_warps"] = max(cfg["num_warps"], 8)   # [32+, 512] fp32 accumulator: 8 warps avoid spills
    cfg["BLOCK_H"] = block_h
    if elem_bytes > 2:
        # fp32 q and cache: a stage of 64 tokens x 576 is 147 KB, so the 16-bit tiles ask for up
        # to 313 KB of the SM's 227 KB (sm_90 compiles: 64-head tiles 311-313 KB); KV tiles of 16
        # tokens keep every orientation under 190 KB (tests/test_gluon_compile.py checks each)
        cfg["BLOCK_N"] = 16
    return cfg, fused, per_slot, (tuple(sorted(cfg.items())), fused, per_slot)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
