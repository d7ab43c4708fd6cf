"""Launch configurations of the VQ kernels: the measured settings and the per-shape choice.

Every function here is cached per problem size, so after the first call of a shape the hot path
is a dictionary lookup (no search at launch time). ``TILEFUSE_CONFIGS``' ``"vq"`` section
(``{"resident": {key: value}, "gather": {key: value}}``) overrides the measured settings for
tuning runs.

Provenance: the resident kernel's and the gather kernel's settings are the H200 sweep's picks,
the switch points the full benchmark's (``docs/vq.md``).
"""

from __future__ import annotations

import functools

from tilefuse import _env

DECODE_MAX_TOKENS = 8            # the gather decode kernel packs up to 8 tokens into its table columns
DECODE_SWITCH_TOKENS = 4         # measured: the resident decode beats dequantize + cuBLAS up to 4 tokens
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
# H200: the resident kernel's row block, warps, and the table build's cost in rows' worth of lookups.
RESIDENT = _with_overrides("resident", dict(block_r=128, num_warps=16, build_rows=256))


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
    return dict(m_pad=m_pad, block_r=RESIDENT["block_r"], num_warps=RESIDENT["num_warps"], k_slices=k_slices,
                chunks=_cdiv(n, rows_per_prog), rows_per_prog=rows_per_prog)


@functools.lru_cache(maxsize=4096)
def prefill_config(m: int, on_gpu: bool) -> dict:
    """Tiles of the fused dequantize-in-registers GEMM (opt-in; slower than dequant + cuBLAS)."""
    if not on_gpu:
        return dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, group_m=4)
    block_m = min(128, max(16, _next_pow2(m)))
    return dict(block_m=block_m, block_n=128, block_k=64, num_warps=8 if block_m >= 64 else 4,
                num_stages=3, group_m=8)


def default_variant(m: int) -> str:
    """The measured dispatch: one-launch decode up to ``DECODE_SWITCH_TOKENS``, dequant + cuBLAS above."""
    return "decode" if m <= DECODE_SWITCH_TOKENS else "dequant"
