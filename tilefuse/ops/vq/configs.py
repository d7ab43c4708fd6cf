"""Launch configurations of the VQ kernels: the measured settings and the per-shape choice.

Every function here is cached per problem size, so after the first call of a shape the hot path
is a dictionary lookup (no search at launch time). ``TILEFUSE_CONFIGS``' ``"vq"`` section
(``{"resident": {...}, "gather": {...}, "mma": {...}, "prefill": {...}}``) overrides the measured settings for
tuning runs.

Provenance: the resident kernel's and the gather kernel's settings are the H200 sweep's picks,
the switch points the full benchmark's (``docs/vq.md``).
"""

from __future__ import annotations

import functools

from tilefuse import _env

DECODE_MAX_TOKENS = 8            # the gather decode kernel packs up to 8 tokens into its table columns
DECODE_SWITCH_TOKENS = 2         # measured: the resident table decode up to 2 tokens (equal at 4096x4096, 15 % faster at 28672x8192), MMA decode above
MMA_SWITCH_TOKENS = 16           # the MMA decode up to this many tokens, the prefill kernel or dequant above
# the WGMMA prefill kernel (Hopper) above MMA_SWITCH_TOKENS up to here (measured at 32-512 tokens),
# dequantize + cuBLAS above (and off Hopper)
PREFILL_MAX_TOKENS = 512
RESIDENT_MAX_TOKENS = 4          # resident table columns = 64 = groups per slice x tokens
TABLE_COLS = 32                  # gather kernel: (token, group) columns of the table per K step


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _with_overrides(section: str, measured: dict) -> dict:
    cfg = dict(measured)
    for key, value in _env.settings.configs.get("vq", {}).get(section, {}).items():
        if key not in cfg:
            raise ValueError(f"TILEFUSE_CONFIGS: vq.{section}: unknown key {key!r}, expected one of {tuple(cfg)}")
        cfg[key] = int(value)
    return cfg


# H200: the gather kernel's tile and split (block_n rows per program, split_mult programs per SM).
GATHER = _with_overrides("gather", dict(block_n=256, num_warps=8, convert_table=1, split_mult=2))
# H200: the resident kernel's row block, warps, the table build's cost in rows' worth of lookups and
# the blocks of code words in flight (2-4).
RESIDENT = _with_overrides("resident", dict(block_r=128, num_warps=16, build_rows=256, ahead=2))
# H200: the MMA decode kernel's row block, K step (krep * 32 inputs), warps, programs resident per SM
# (64 KB of codebook copies: at most 3) and the fixed cost of a program (codebook copies, epilogue)
# in K steps' worth, which the split-K choice weighs against wave quantization.
MMA = _with_overrides("mma", dict(block_n=256, krep=4, num_warps=4, ctas_per_sm=2, fixed_steps=4))
# H200: the ``tl`` twin of the prefill kernel (``kernels.vq_mma_kernel``; off Hopper) and its tiles.
PREFILL = _with_overrides("prefill", dict(block_n=128, tokens=128, block_k=64, num_warps=8, num_stages=3))
# H200: the WGMMA prefill kernel (``kernels_prefill``): warps (16 weight rows each), tokens per tile
# (0: chosen per shape by ``wgmma_prefill_config``), x ring depth (0: as deep as shared memory
# allows, up to 6), a program's fixed cost in K steps' worth (the split-K choice) and ws: 1 for the
# warp-specialized form (a TMA producer warp, two consumer warpgroups: 128 rows).
WGMMA_PREFILL = _with_overrides("prefill_wgmma", dict(num_warps=8, block_m=0, stages=0, fixed_steps=8, ws=1))
WGMMA_PREFILL_SMEM = 196608      # bytes of shared memory the codebook copies and the x ring may take
# The small-layer kernel (``kernels_small``: a program owns 16 * row_tiles rows and the whole of K,
# split over its warps): K step (krep * 32 inputs), copies of each codebook entry in shared memory
# (1-8), the most K slices (warps) per program, row tiles per program, and the fixed cost of a
# program in K steps' worth, which the slice choice weighs (``small_config``).
SMALL = _with_overrides("small", dict(krep=4, copies=8, max_slices=8, row_tiles=1, fixed_steps=2))
SMALL_MAX_TOKENS = 128           # the cost model offers the small-layer kernel up to here (forced: any M)


@functools.lru_cache(maxsize=4096)
def gather_config(m: int, n: int, k: int, on_gpu: bool, num_sms: int) -> dict:
    """Tile, table packing and K split of the gather (and ``tl``) decode kernel for M <= 8 tokens."""
    m_pad = _next_pow2(m)
    if on_gpu:
        block_n, num_warps = GATHER["block_n"], GATHER["num_warps"]
    else:   # the CPU interpreter: small tiles
        block_n, num_warps = min(64, max(16, _next_pow2(n))), 4
    groups = k // 8
    gm = TABLE_COLS // m_pad
    steps = _cdiv(groups, gm)
    # split K so that about split_mult programs per SM run (one CTA fits an SM: ~255 registers)
    split = max(1, min(steps, round(GATHER["split_mult"] * num_sms / _cdiv(n, block_n))))
    groups_per_split = _cdiv(steps, split) * gm
    return dict(block_n=block_n, num_warps=num_warps, cols=TABLE_COLS, m_pad=m_pad,
                split_k=_cdiv(groups, groups_per_split), groups_per_split=groups_per_split,
                convert_table=bool(GATHER["convert_table"]))


@functools.lru_cache(maxsize=4096)
def resident_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """Grid of the resident kernel: K slices of ``64 / M_PAD`` groups x row chunks.

    One CTA per SM (the 128 KB table), so the row-chunk count ``c`` minimizes
    ``waves(c) * (rows per program + build_rows)``; ``build_rows`` is the table build's cost in
    rows' worth of lookups (measured on the H200, see docs/vq.md)."""
    m_pad = _next_pow2(m)
    k_slices = _cdiv(k // 8, 64 // m_pad)

    def cost(c):
        return _cdiv(k_slices * c, num_sms) * (_cdiv(n, c) + RESIDENT["build_rows"])

    chunks = min(range(1, _cdiv(n, 32) + 1), key=lambda c: (cost(c), c))
    rows_per_prog = _cdiv(_cdiv(n, chunks), 32) * 32
    return dict(m_pad=m_pad, block_r=RESIDENT["block_r"], num_warps=RESIDENT["num_warps"], ahead=RESIDENT["ahead"],
                k_slices=k_slices, chunks=_cdiv(n, rows_per_prog), rows_per_prog=rows_per_prog)


@functools.lru_cache(maxsize=4096)
def mma_config(m: int, n: int, k: int, impl: str, num_sms: int) -> dict:
    """Tiles and K split of the dequantize-in-registers MMA kernels.

    impl: "gluon" (``kernels_mma``, the decode kernel), "tl" (``kernels.vq_mma_kernel`` on the GPU:
    the fused prefill tiles) or "interpret" (the ``tl`` kernel on the CPU: small tiles). One token
    tile of ``tokens`` (>= 16, an MMA's least N) splits K to minimize ``waves x (K steps per program
    + fixed_steps)``; more tokens run token tiles without a split."""
    groups = k // 8
    if impl == "gluon" and m <= 16:
        block_n, num_warps, krep, num_stages, tokens = MMA["block_n"], MMA["num_warps"], MMA["krep"], 1, 16
        bg = 4 * krep
    elif impl == "gluon":   # 64-token tiles: x^T takes the registers, so 8 warps of 16 rows, 64-input steps
        block_n, num_warps, krep, num_stages, tokens, bg = 128, 8, 2, 1, 64, 8
    elif impl == "tl":
        block_n, num_warps, num_stages = PREFILL["block_n"], PREFILL["num_warps"], PREFILL["num_stages"]
        tokens, bg, krep = min(PREFILL["tokens"], max(16, _next_pow2(m))), PREFILL["block_k"] // 8, None
    else:
        block_n, num_warps, tokens, bg, krep, num_stages = 32, 4, 16, 4, None, 1
    token_tiles = _cdiv(m, tokens)
    steps = _cdiv(groups, bg)
    row_blocks = _cdiv(n, block_n)
    split = 1
    if token_tiles == 1 and impl != "tl":   # least waves x (steps per program + fixed cost)
        slots = MMA["ctas_per_sm"] * num_sms

        def cost(s):
            return _cdiv(row_blocks * s, slots) * (_cdiv(steps, s) + MMA["fixed_steps"])

        split = min(range(1, steps + 1), key=lambda s: (cost(s), s))
    groups_per_split = _cdiv(steps, split) * bg
    return dict(block_n=block_n, tokens=tokens, block_k=8 * bg, krep=krep, num_warps=num_warps,
                num_stages=num_stages, token_tiles=token_tiles, row_blocks=row_blocks,
                groups_per_split=groups_per_split, split_k=_cdiv(groups, groups_per_split), even=groups % bg == 0)


@functools.lru_cache(maxsize=4096)
def wgmma_prefill_config(m: int, n: int, k: int, num_sms: int, block_m: int = 0, stages: int = 0,
                         num_warps: int = 0, split_k: int = 0, ws: int = -1) -> dict:
    """Tiles and K split of the WGMMA prefill kernel: ``block_m`` tokens per tile, the largest of 64,
    128 and 256 (up to the tokens rounded to a power of two) whose tiles still give half of the SMs
    one each, else 64 (the H200 sweep's picks, ``tools/vq_prefill_sweep.py``); ``block_n = 16 x
    num_warps`` weight rows; where the tiles leave SMs idle (fewer than one per SM), K is split to
    minimize ``waves x (steps per program + fixed_steps)``. Explicit arguments override; ``ws`` (1:
    the warp-specialized kernel, 128 rows) defaults to the measured setting."""
    ws = WGMMA_PREFILL["ws"] if ws < 0 else ws
    num_warps = 8 if ws else num_warps or WGMMA_PREFILL["num_warps"]
    block_n = 16 * num_warps
    row_blocks = _cdiv(n, block_n)
    block_m = block_m or WGMMA_PREFILL["block_m"]
    if not block_m:
        fits = [bm for bm in (128, 256) if bm <= _next_pow2(m) and _cdiv(m, bm) * row_blocks >= num_sms // 2]
        block_m = max(fits, default=64)
    ring_slot = block_m * 64 * 2
    stages = stages or WGMMA_PREFILL["stages"] or min(6, (WGMMA_PREFILL_SMEM - 65536) // ring_slot)
    tiles = _cdiv(m, block_m) * row_blocks
    steps = k // 64
    if not split_k and tiles >= num_sms:
        split_k = 1      # a full wave of tiles: no fp32 partials
    if not split_k:
        def split_cost(s):
            return _cdiv(tiles * s, num_sms) * (_cdiv(steps, s) + WGMMA_PREFILL["fixed_steps"])

        split_k = min(range(1, min(steps, 16) + 1), key=lambda s: (split_cost(s), s))
    steps_per_split = _cdiv(steps, split_k)
    split_k = _cdiv(steps, steps_per_split)
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, stages=stages, split_k=split_k,
                groups_per_split=8 * steps_per_split, grid=(_cdiv(m, block_m), row_blocks, split_k), ws=ws)


@functools.lru_cache(maxsize=4096)
def small_config(m: int, n: int, k: int, on_gpu: bool, num_sms: int, slices: int = 0, copies: int = 0,
                 krep: int = 0, tokens: int = 0, row_tiles: int = 0) -> dict:
    """Tiles and in-program K split of the small-layer kernel (``kernels_small``).

    ``tokens`` per program (8 up to 8 tokens, else 16; token tiles above), ``rows = 16 x row_tiles``
    output rows per program, K in ``slices`` warps' slices of ``groups_per_slice`` groups (a
    multiple of the ``4 x krep``-group step): the fewest slices (1, 2, 4, 8) that bring the
    estimated time ``waves x (steps per warp + fixed_steps)`` to within 10 % of the most slices'
    (a warp's steps run one after the other; every warp of a program shares the SM's shared-memory
    pipe with the program's other warps; at least 2). Explicit arguments override (tuning and tests). On the CPU
    interpreter (``on_gpu`` False): the ``tl`` twin with 4-group steps, so small tests cross steps
    and slices."""
    groups = k // 8
    row_tiles = row_tiles or (SMALL["row_tiles"] if on_gpu else 1)
    krep = krep or (SMALL["krep"] if on_gpu else 1)
    tokens = tokens or ((8 if m <= 8 else 16) if on_gpu else 16)
    copies = copies or SMALL["copies"]
    bg = 4 * krep
    steps = _cdiv(max(groups, 1), bg)
    rows = 16 * row_tiles
    programs = _cdiv(n, rows) * _cdiv(m, tokens)
    slices = slices or _small_slices(programs, steps, row_tiles, copies * 8192, rows, on_gpu, num_sms)
    groups_per_slice = _cdiv(steps, slices) * bg      # slices past K's end (a power of two of warps) add nothing
    return dict(tokens=tokens, krep=krep, row_tiles=row_tiles, slices=slices, copies=copies, rows=rows,
                groups_per_slice=groups_per_slice, even=groups == slices * groups_per_slice,
                grid=(_cdiv(n, rows), _cdiv(m, tokens), 1), num_warps=row_tiles * slices)


def _small_slices(programs: int, steps: int, row_tiles: int, copies_bytes: int, rows: int, on_gpu: bool,
                  num_sms: int) -> int:
    """K slices (warps per row tile) of a small-layer program: the fewest of 2, 4, 8 that bring
    ``waves x (steps per warp + fixed_steps)`` to within 10 % of the best (``copies_bytes``: the
    program's codebook copies in shared memory, which bound the programs resident per SM)."""
    # at least 2 warps: with one, ptxas spills the kernel (its register heuristic for 32 threads)
    options = [s for s in (2, 4, 8) if s <= SMALL["max_slices"] and s * row_tiles <= 16]
    if not on_gpu:
        options = [s for s in options if s <= 4]

    def cost(s):
        # programs resident per SM: 64 warps and the shared memory of the copies
        per_sm = max(1, min(64 // (s * row_tiles), (227 * 1024) // (copies_bytes + 16 * s * rows * 4)))
        return _cdiv(programs, per_sm * num_sms) * (_cdiv(steps, s) + SMALL["fixed_steps"])

    best = min(cost(s) for s in options)
    return min(s for s in options if cost(s) <= 1.1 * best)


# MoE experts (``kernels_moe``: a program per token-expert pair and row block, one token): codebook
# copies per entry, row tiles per program and K step. Chosen before any timing as the fused
# gate/up's copies (4; shorter programs than a dense layer's, so fewer copies to fill) and the
# small kernel's tiles; the first H100 run times the alternatives (docs/vq.md).
# group_pairs: from this many token-expert pairs on, programs take tiles of one expert's tokens
# (sorted on the device first, ``op.moe_schedule``) instead of one pair each. H100, both forced at
# 1-128 tokens (bench/results/sweeps/vq-moe-h100-80gb-hbm3-quick.json, tools/vq_moe_bench.py): the
# schedule's PyTorch ops cost about 75 us of graph replay, so a program per pair is faster up to
# 128 pairs (317 against 432 us at 16 tokens x top-8) and the tiles from 192 on (422 against 662
# us at 32 tokens x top-6; 744 against 2365 us at 128 x 8). The run's model row used 128.
# schedule_kernel: 1 computes that schedule in one launch (``kernels_moe.vq_moe_schedule_kernel``,
# bit-identical to ``op.moe_schedule``), 0 with ``op.moe_schedule``'s PyTorch ops (the reference;
# also used above ``MOE_SCHEDULE_BINS - 1`` experts); schedule_block: pairs (and tiles) per step
# of that kernel, a power of two. Not yet timed on a GPU: group_pairs was measured with the
# PyTorch schedule and may move lower with the kernel.
MOE = _with_overrides("moe", dict(copies=4, row_tiles=1, krep=4, group_pairs=160, schedule_kernel=1,
                                  schedule_block=1024, dequant_pairs=3072))
# dequant_pairs: from this many token-expert pairs on, vq_moe dequantizes every expert into a
# scratch weight and runs PyTorch's grouped GEMM (op.launch_moe_dequant; bf16 only), 0: never.
# Measured on the H100 against the tiles (tools/vq_moe_bench.py --tokens 256,512,1024,2048,
# bench/results/sweeps/vq-moe-dequant-h100-80gb-hbm3.json, graph replay): Qwen3-30B-A3B's experts
# (top-8) 1128 against 999 us at 2048 pairs, 1227 against 1697 at 4096, 1987 against 5982 at
# 16384; a held-out E64 2048 x 1408 top-6 level at 1536 pairs (1030 / 1014), 1134 against 1801 at
# 3072. The path costs about 1 ms whatever the pairs (all experts' bf16 weights written, then
# read), the tiles grow with the pairs: the crossover lies at 2000-3000 pairs. It stays 0.55-0.7x
# the bf16 experts' time there (the dequantization is the difference).
MOE_SCHEDULE_BINS = 1024        # the schedule kernel's most expert bins (E + 1 rounded up to a power of two)


@functools.lru_cache(maxsize=4096)
def moe_config(programs: int, n: int, k: int, on_gpu: bool, num_sms: int, copies: int = 0, row_tiles: int = 0,
               krep: int = 0, slices: int = 0, tokens: int = 0, books: int = 1) -> dict:
    """Tiles of the MoE expert kernels (``kernels_moe``) on ``programs`` token-expert pairs (or
    grouped tiles of one expert's tokens) of an ``[n, k]`` projection per expert (the gate/up
    kernel: ``n`` = I rows of each of gate and up, ``books`` codebook pairs staged). ``tokens``:
    the MMA's columns per program (8 on the GPU, the ``tl`` twin's 16 in the interpreter; 1 asks
    for the smallest, as a program per pair uses one); grid ``(programs, row blocks)``. Explicit
    arguments override (tuning and tests)."""
    groups = k // 8
    row_tiles = row_tiles or (MOE["row_tiles"] if on_gpu else 1)
    krep = krep or (MOE["krep"] if on_gpu else 1)
    copies = copies or MOE["copies"]
    tokens = 16 if not on_gpu else 16 if tokens > 8 else 8
    bg = 4 * krep
    steps = _cdiv(max(groups, 1), bg)
    rows = 16 * row_tiles
    blocks = programs * _cdiv(n, rows)
    slices = slices or _small_slices(blocks, steps, row_tiles, books * copies * 8192, rows, on_gpu, num_sms)
    groups_per_slice = _cdiv(steps, slices) * bg
    return dict(tokens=tokens, krep=krep, row_tiles=row_tiles, slices=slices, copies=copies, rows=rows,
                groups_per_slice=groups_per_slice, even=groups == slices * groups_per_slice,
                grid=(programs, _cdiv(n, rows), 1), num_warps=row_tiles * slices)



def moe_schedule_meta(pairs: int, num_experts: int) -> dict | None:
    """The schedule kernel's constexprs and warps (``kernels_moe.vq_moe_schedule_kernel``, one
    program) for ``pairs`` token-expert pairs over ``num_experts`` experts, or None where the
    PyTorch schedule runs (``MOE["schedule_kernel"]`` 0, or more experts than its bins hold).
    EXPERTS: bins for the ids in range and the out-of-range key E, a power of two, at least a
    warp's 32 lanes; BLOCK: pairs per step, the pairs rounded up to a power of two up to
    ``MOE["schedule_block"]``, at least one per thread (``tl.histogram`` then sees no replicated
    lanes)."""
    bins = max(32, _next_pow2(num_experts + 1))
    if not MOE["schedule_kernel"] or bins > MOE_SCHEDULE_BINS:
        return None
    block = min(_next_pow2(pairs), _next_pow2(MOE["schedule_block"]))
    warps = 8 if max(block, bins) >= 512 else 4
    block = max(block, 32 * warps)
    return dict(EXPERTS=bins, LOG_EXPERTS=bins.bit_length() - 1, BLOCK=block, num_warps=warps)

def wgmma_prefill_meta(cfg: dict, has_bias: bool) -> dict:
    """The WGMMA prefill kernel's constexprs and launch warps (``num_warps``) for ``cfg`` (from
    :func:`wgmma_prefill_config`). The warp-specialized form's consumers get 232 registers for
    256-token tiles (128 accumulators per thread), 160 below."""
    split = cfg["split_k"] > 1
    if cfg["ws"]:
        return dict(BLOCK_M=cfg["block_m"], STAGES=cfg["stages"], SPLIT=split, HAS_BIAS=has_bias,
                    CONSUMER_REGS=232 if cfg["block_m"] > 128 else 160, num_warps=4)
    return dict(BLOCK_N=cfg["block_n"], BLOCK_M=cfg["block_m"], STAGES=cfg["stages"], NUM_WARPS=cfg["num_warps"],
                SPLIT=split, HAS_BIAS=has_bias, num_warps=cfg["num_warps"])


def default_variant(m: int, wgmma_prefill: bool = False) -> str:
    """The measured dispatch: the table decode up to ``DECODE_SWITCH_TOKENS``, the MMA decode up to
    ``MMA_SWITCH_TOKENS``, then where the WGMMA prefill kernel runs (``wgmma_prefill``: a Hopper GPU,
    K a multiple of 64) that kernel up to ``PREFILL_MAX_TOKENS``; dequant + cuBLAS otherwise (above
    it, the dequantization's fixed cost shrinks against the GEMM's)."""
    if m <= DECODE_SWITCH_TOKENS:
        return "decode"
    if m <= MMA_SWITCH_TOKENS:
        return "mma"
    return "prefill" if wgmma_prefill and m <= PREFILL_MAX_TOKENS else "dequant"


# ------------------------------------------------------------------------------- cost model
# Each variant's graph-replay time as a fixed cost plus measured multiples of its roofline terms,
# fitted (least squares on relative error) to tools/vq_variant_sweep.py on the H200: 16 layers of
# the shape corpus from 896 x 112 to 59136 x 8192 (held-out models excluded) at 1-512 tokens,
# bench/results/sweeps/vq-variants-h200.json. Terms: ``codes`` = N K / 4 bytes of codes at the
# copy bandwidth (us); ``mma`` = the MMA work the kernel issues (tokens padded to its tile) in
# units of 10^6 N K rows; ``busiest`` = the WGMMA prefill's work on its busiest SM (waves x one
# tile's block_m x block_n x K / split) / 10^6; ``stream`` = codes + x + y bytes at the copy
# bandwidth; ``dense`` = N K x 2.25 bytes (write the fp16 weight, read the codes) at the copy
# bandwidth; ``gemm`` = cuBLAS's GEMM (``_dispatch.gemm_us``). Median error 0-4 %, 5-95 % range
# 0.6-1.3x (the prefill kernel's wave steps are the worst); hence the margin below.
COST = {
    "decode": dict(fixed=10.3, codes=0.457, mma=0.109),        # M <= 2: M x N x K work
    # M <= 16: 16-token tiles, plus a term in the tokens themselves (x^T loads and split-K partials
    # grow with them): refitted on the 120 MMA points at <= 16 tokens of vq-variants-h200.json and
    # vq-small-h200.json (median 0.97, range 0.75-1.27; without the token term it underestimated
    # 16 tokens by up to 20 %: 4096 x 4096, 14.6 predicted against 17.8 measured)
    "mma": dict(fixed=10.19, codes=0.0, mma=0.01477, tokens=0.00601),
    "prefill": dict(fixed=11.6, busiest=0.326, stream=4.16),
    "dequant": dict(fixed=1.63, dense=1.66, gemm=0.805),
    # M <= 128, the small-layer kernel (``small_config``'s tiles): ``steps`` = waves of programs x K
    # steps per warp, ``x`` = waves x (tokens of a program's tile) x K / 10^6 (the x^T a program
    # reads: every program reads all of K for its tokens), ``waves`` = waves of programs (each
    # stages its codebook copies in shared memory first). Fitted (least squares on relative error)
    # on tools/vq_small_sweep.py's runs: H200 (bench/results/sweeps/vq-small-h200.json, 8 layers
    # from 512 x 2048 to 14336 x 4096 at 1-16 tokens) and H100 (vq-small-h100-80gb-hbm3.json, the
    # same layers at 1-128 tokens): predictions 0.87-1.09x of the measured times (14336 x 4096 at
    # 16 tokens the low end, where the MMA decode is far faster anyway). The form before, without
    # the waves term and fitted at 1-16 tokens, predicted 0.73x at 64-128 tokens on 2048 x 768.
    "small": dict(fixed=6.39, steps=0.502, x=32.9, waves=0.843),
}
# A kernel runs in place of the dequant + cuBLAS baseline only if predicted faster by this much:
# the model's spread above; with it, no measured point of the sweep is more than 1.35x the
# baseline (without, 2.4x), and the geometric mean is 1.6 % above the best variant's time.
MARGIN = 0.10
# Between kernels the small-layer kernel ranks by its prediction over (1 + SMALL_BIAS): on the
# layers it serves, the other kernels' models (fitted mostly on larger layers) underestimate them
# (the MMA decode and the resident decode by up to 12 %, in vq-small-h200.json), while the small kernel measured at or below the MMA decode's and the resident
# decode's times at all 35 of its points on layers up to 4096 x 4096 (on 14336 x 4096 it is
# 1.1-1.5x slower and predicted 1.2-1.4x slower: not picked).
SMALL_BIAS = 0.10


def predict_us(variant: str, m: int, n: int, k: int, chip, num_sms: int | None = None) -> float | None:
    """Predicted graph-replay time (us) of ``variant`` on ``x [m, k] @ W[n, k]^T``, fp16/bf16, on
    ``chip`` (``_dispatch.Chip``); None where the variant does not take ``m`` tokens (decode
    above 2 or with an odd number of 8-wide groups, mma above 16, small above 128 or with N or K not a
    multiple of 128, the WGMMA prefill above
    ``PREFILL_MAX_TOKENS`` or K not a multiple of 64)."""
    from tilefuse import _dispatch

    bw = chip.copy_bytes_per_us
    c = COST[variant]
    codes = n * k / 4 / bw
    if variant == "decode":
        # the resident table decode only (an even number of 8-wide groups): the gather form that
        # serves odd K/8 plans its launch on every call, tens of microseconds of host time
        if m > DECODE_SWITCH_TOKENS or (k // 8) % 2:
            return None
        return c["fixed"] + c["codes"] * codes + c["mma"] * m * n * k / 1e6
    if variant == "mma":
        if m > MMA_SWITCH_TOKENS:
            return None
        return c["fixed"] + (c["mma"] * 16 * _cdiv(m, 16) + c["tokens"] * m) * n * k / 1e6
    if variant == "small":
        # offered where its GPU runs cover the shape: N and K multiples of 128, as in every model
        # layer (bench/results/sweeps/vq-small-h200.json checks each output it times); other sizes
        # keep the older kernels unless the variant is forced
        if m > SMALL_MAX_TOKENS or n % 128 or k % 128:
            return None
        sms = num_sms or chip.sms
        cfg = small_config(m, n, k, True, sms)
        waves = _cdiv(cfg["grid"][0] * cfg["grid"][1], sms)
        steps = cfg["groups_per_slice"] // (4 * cfg["krep"])          # K steps per warp
        return (c["fixed"] + c["steps"] * waves * steps + c["x"] * waves * min(m, cfg["tokens"]) * k / 1e6
                + c["waves"] * waves)
    if variant == "prefill":
        if m > PREFILL_MAX_TOKENS or k % 64:
            return None
        cfg = wgmma_prefill_config(m, n, k, num_sms or chip.sms)
        gm, gn, gs = cfg["grid"]
        busiest = _cdiv(gm * gn * gs, num_sms or chip.sms) * cfg["block_m"] * cfg["block_n"] * k / gs
        stream = (n * k / 4 + 2 * m * k + 2 * m * n) / bw
        return c["fixed"] + c["busiest"] * busiest / 1e6 + c["stream"] * stream
    dense = n * k * 2.25 / bw
    return c["fixed"] + c["dense"] * dense + c["gemm"] * _dispatch.gemm_us(chip, m, n, k)


# The unfused gate/up's epilogue (``vq_swiglu_epilogue_kernel``: 2 x M x N reads, M x N writes) in
# the cost model: one more graph node's fixed cost (the H100 sweep: the fused path's unfused form
# with it is 1.8-4.8 us faster than two vq_matmul calls plus PyTorch's SiLU * up, two nodes).
SWIGLU_EPILOGUE_US = 2.0


@functools.lru_cache(maxsize=4096)
def decide_swiglu(m: int, n: int, k: int, wgmma_prefill: bool, chip=None, num_sms: int | None = None) -> bool:
    """Whether ``vq_swiglu`` on ``x [m, k]`` and two ``[n, k]`` weights runs the fused kernel: its
    time modelled as the small-layer kernel's on ``2n`` rows (a program owns 16 rows of both
    weights: the same programs, codebook staging and x^T per row as ``2n`` rows of one weight),
    against two calls of ``vq_matmul``'s pick for ``[n, k]`` and the one-pass epilogue, the faster
    prediction wins. Checked on an H100 (bench/results/sweeps/vq-swiglu-h100-80gb-hbm3.json: 7
    gate/up sizes at 1-128 tokens, the fused kernel forced beside the unfused path): the faster
    path at every point, 8960 x 1536 at one token a near-tie (24.8 us fused); with a 10 %
    margin for the fused kernel it ran 8960 x 1536 at 16 tokens unfused, 1.17x the fused time.
    None of the small kernel's sizes (``n`` or ``k`` not a multiple of 128, more than
    :data:`SMALL_MAX_TOKENS` tokens): False."""
    fused, _, unfused = swiglu_predictions(m, n, k, wgmma_prefill, chip, num_sms)
    return fused is not None and fused < unfused


def swiglu_predictions(m: int, n: int, k: int, wgmma_prefill: bool, chip=None, num_sms: int | None = None):
    """(the fused kernel's predicted us or None where the small kernel does not take the size,
    ``decide``'s Choice for one ``[n, k]`` projection, the unfused path's predicted us: two of
    that pick and the epilogue): what :func:`decide_swiglu` weighs."""
    from tilefuse import _dispatch

    fused = predict_us("small", m, 2 * n, k, chip or _dispatch.CHIPS["H200"], num_sms)
    pick = decide(m, n, k, wgmma_prefill, chip, num_sms)
    unfused = 2 * next(c.predicted_us for c in pick.candidates if c.variant == pick.variant) + SWIGLU_EPILOGUE_US
    return fused, pick, unfused


@functools.lru_cache(maxsize=4096)
def decide(m: int, n: int, k: int, wgmma_prefill: bool, chip=None, num_sms: int | None = None):
    """The VQ decision for one problem size, as a ``_dispatch.Choice``: every variant that takes
    ``m`` tokens with its predicted time (:func:`predict_us`); the fastest kernel runs where it
    beats the dequant + cuBLAS baseline by :data:`MARGIN`, else the baseline (among the kernels, the
    small-layer kernel's prediction counts :data:`SMALL_BIAS` less). ``wgmma_prefill``:
    the WGMMA prefill kernel runs on this device and K. Cached per size."""
    from tilefuse import _dispatch

    chip = chip or _dispatch.CHIPS["H200"]
    names = ("decode", "mma", "small", "prefill", "dequant") if wgmma_prefill else ("decode", "mma", "small", "dequant")
    weighed = tuple(_dispatch.Candidate(v, None, predict_us(v, m, n, k, chip, num_sms),
                                        "dequantize into a scratch weight, then cuBLAS" if v == "dequant" else "")
                    for v in names)
    baseline = weighed[-1]
    pick = baseline
    kernels = sorted((c for c in weighed[:-1] if c.predicted_us is not None),
                     key=lambda c: c.predicted_us / (1 + SMALL_BIAS) if c.variant == "small" else c.predicted_us)
    if kernels and kernels[0].predicted_us * (1 + MARGIN) < baseline.predicted_us:
        pick = kernels[0]
    return _dispatch.Choice("vq", {"M": m, "N": n, "K": k}, pick.variant, None, "cost model", weighed)
