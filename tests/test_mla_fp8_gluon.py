"""The Gluon dense FP8 MLA kernel's two forms (``kernels_gluon_fp8``: serial, and warp-specialized
with converter warps, ``kernels_gluon_fp8_ws``): their launch configs and TMA boxes on the CPU;
on Hopper, each form against the fp64 reference on the dequantized cache (the tolerances of
``tests/test_mla.py``'s ``_check_gpu``: out atol = rtol = 1e-2 for bf16 q and the fp16 rounding of
the dequantized codes, lse 1e-3) over lengths that end at every boundary the forms have (ring slot,
K tile, page, split), NaN bytes in every unused slot, runs of splits per program, and CUDA graph
replay."""

import random
import re

import pytest
import torch

import tilefuse
from tilefuse.ops.mla import configs, op
from tilefuse.testing import captured
from tilefuse.testing.mla import make_case
from tests.test_mla import _check_gpu, _poison_unused_fp8_slots

FORMS = {
    "ws": lambda: configs.FP8_GLUON_WS,
    "serial": lambda: configs.FP8_GLUON_SERIAL,
    "ws-conv4": lambda: {k: dict(v, CONVERTERS=4) for k, v in configs.FP8_GLUON_WS.items()},
    "ws-slot16": lambda: {k: dict(v, SLOT_N=16, STAGES=2 * v["STAGES"], CONVERTERS=4)
                          for k, v in configs.FP8_GLUON_WS.items()},
    "ws-ahead": lambda: {k: dict(v, MMA_AHEAD=1) for k, v in configs.FP8_GLUON_WS.items()},
    "rs": lambda: configs.FP8_GLUON_RS,
    "rs-s3": lambda: {k: dict(v, STAGES=3) for k, v in configs.FP8_GLUON_RS.items()},
    "rs2": lambda: configs.FP8_GLUON_RS2,
}


def _converter_layout_fits(cfg: dict) -> bool:
    """The converters' layout (kernels_gluon_fp8_ws.fp8_ws_converter): warps down the slot's rows,
    8 rows each, and at most 2 warps across a 128-code group."""
    warps, slot = cfg["CONVERTERS"], cfg["SLOT_N"]
    return warps // min(warps, slot // 8) <= 2


def test_fp8_gluon_forms_fit_the_converter_layout():
    """Every warp-specialized launch the configs and the sweep use fits the converters' layout
    (the kernel's static_assert; 8 converter warps need slots of 32 tokens or more)."""
    for name, form in FORMS.items():
        for cfg in form().values():
            if cfg["CONVERTERS"]:
                assert _converter_layout_fits(cfg), (name, cfg)
    assert not _converter_layout_fits(dict(CONVERTERS=8, SLOT_N=16))


def test_fp8_gluon_config_by_rows():
    """Rows pick the smallest tile that holds them; each config is one of the two forms; rows
    outside 1..FP8_GLUON_MAX_ROWS are refused by name."""
    for rows in (1, 8, 16, 17, 24, 32, 48, 64):
        cfg = configs.fp8_gluon_config(rows)
        assert cfg["BLOCK_H"] == (16 if rows <= 16 else 32)
        if cfg.get("CONVERTERS", 0):
            assert cfg["num_warps"] == 4 and 64 % cfg["SLOT_N"] == 0
        else:
            assert cfg["SLOT_N"] == 64
    for rows in (0, configs.FP8_GLUON_MAX_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            configs.fp8_gluon_config(rows)


@pytest.mark.parametrize("page,slot_n", [(16, 32), (64, 32), (128, 32), (64, 16), (64, 64)])
def test_fp8_descriptors_box_is_the_ring_slot(page, slot_n):
    """The TMA boxes (``op._fp8_descriptors``) are the form's ring slot of ``SLOT_N`` rows, or a
    page where pages are shorter; without a slot, 64 rows (the serial form's tile)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    packed = tilefuse.mla_quantize_kv(torch.randn(3 * page, 576).to(torch.bfloat16)).view(3, page, 1, 656)
    codes, scales = op._fp8_descriptors(packed, slot_n)
    box = min(page, slot_n)
    assert codes.block_shape == [box, 128] and scales.block_shape == [box, 4]
    assert op._fp8_descriptors(packed)[0].block_shape == [min(page, 64), 128]


@pytest.mark.parametrize("form,rows,page", [("rs", 16, 64), ("rs", 32, 64), ("rs", 16, 16), ("rs", 32, 128),
                                            ("rs2", 16, 64), ("rs2", 32, 16)])
def test_fp8_gluon_rs_compiles(form, rows, page):
    """The register-operand form (``configs.FP8_GLUON_RS``, one MMA warpgroup; ``FP8_GLUON_RS2``,
    two) compiles for sm_90a: within the SM's shared memory (4 ring slots of 64 tokens; with two
    warpgroups 3 or 2, their P_g^T and the exchange buffer), TMA copies, the bf16 RoPE WGMMA from
    the landed bytes, fp16 WGMMAs with the A operand in registers (N = BLOCK_H, nothing padded),
    two codes per conversion, 16-bit loads of K's codes and byte loads of V^T's. ptxas keeps some
    of the loop's shared-memory addresses in local memory (an MMA warpgroup's 232-255 registers
    hold O^T, two A operands and the addresses of 384 loads per tile): bounded so that growth
    shows."""
    gluon = pytest.importorskip("tilefuse.testing.gluon")
    from tests.test_gluon_compile import CONSTEXPR, MLA_SPLIT_SCALARS, SMEM_LIMIT

    cfg = dict(FORMS[form]()[rows])
    box = min(page, cfg["SLOT_N"])
    pointers = ["q_ptr", "bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr", "out_ptr", "lse_ptr", "oacc_ptr",
                "lseacc_ptr"]
    signature = {"q_ptr": "*bf16", "codes_desc": gluon.tensordesc(torch.float8_e4m3fn, [box, 128]),
                 "scales_desc": gluon.tensordesc(torch.float32, [box, 4]), "bt_ptr": "*i32", "seqlens_ptr": "*i32",
                 "meta_ptr": "*i32", "splits_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "oacc_ptr": "*fp32", "lseacc_ptr": "*fp32", **MLA_SPLIT_SCALARS}
    constexprs = dict(CAUSAL=True, KV_PAGE=page, **cfg)
    signature.update({name: CONSTEXPR for name in constexprs})
    result = gluon.compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon_fp8:mla_split_fp8_kernel", signature,
                                          constexprs, num_warps=cfg["num_warps"], aligned=pointers)
    assert result.shared <= SMEM_LIMIT, result.shared
    assert result.spilled <= {("rs", 16): 800, ("rs", 32): 2800, ("rs2", 16): 1800, ("rs2", 32): 4400}[form, rows], \
        result.ptxas
    ptx = result.ptx
    per_wg = 2 if cfg["RS"] == 2 else 1                   # the PTX holds each warpgroup's code
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16" in ptx      # RoPE: SS, from the ring
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{rows}k16\.f32\.f16\.f16\s+\{{[^}}]*\}},\s*\{{", ptx)
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 256 * per_wg       # 64 x 512 codes, twice, over 128 threads
    assert ptx.count("ld.shared.b16") == 128 * per_wg and ptx.count("ld.shared.b8") >= 256 * per_wg


def _use_form(monkeypatch, form: str, max_rows: int | None = None) -> None:
    """The transposed FP8 kernel in ``form`` at every row count it takes (the 64-row tiles out of
    the way)."""
    monkeypatch.setattr(configs, "FP8_GLUON_CONFIGS", {k: dict(v) for k, v in FORMS[form]().items()})
    monkeypatch.setattr(configs, "FP8_WIDE_FROM_ROWS", 1 << 30)
    if max_rows is not None:
        monkeypatch.setattr(configs, "FP8_GLUON_MAX_ROWS", max_rows)
    configs.launch_config.cache_clear()
    op._plans.clear()


def _decode(lens, s_q, h_q, page, causal=True, graph=False):
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=page, nan_tail=False)
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache).cpu(), inp.block_table.cpu(), lens).cuda()
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)

    def call():
        return tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                               causal=causal, is_fp8_kvcache=True)
    choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, inp.q, packed, inp.block_table, inp.cache_seqlens,
                              is_fp8_kvcache=True)
    out, lse = call()
    if graph:
        g, (g_out, g_lse) = captured(call)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.bfloat16)
    return inp, out, lse, choice


# lengths ending at each boundary: 0, 1, a ring slot of 16 / 32 (+-1), a K tile of 64 (+-1), pages,
# and long ones that the schedule splits across programs
EDGES = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 777, 4000, 20000]


def _need_hopper():
    if not op.wgmma_usable(torch.device("cuda")):
        pytest.skip("the Gluon FP8 kernel runs on Hopper")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "serial", "ws-ahead", "rs", "rs2"])
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, True), (8, 4, True), (24, 1, False), (5, 3, True), (1, 1, True)])
def test_gpu_fp8_gluon_forms(monkeypatch, form, page, h_q, s_q, causal):
    """Each form at 1-32 query rows (one head tile of 16 or 32, partial tiles included), pages
    shorter than, equal to and longer than a ring slot and a K tile: the fp64 reference."""
    _need_hopper()
    _use_form(monkeypatch, form)
    inp, out, lse, choice = _decode(EDGES, s_q, h_q, page, causal)
    assert choice.variant == "wgmma_fp8", choice
    _check_gpu(out, lse, inp, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws-conv4", "ws-slot16", "ws-ahead"])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (16, 2)])
def test_gpu_fp8_gluon_ws_variants(monkeypatch, form, h_q, s_q):
    """The warp-specialized form's variants the sweep times (4 converter warps; ring slots of 16
    tokens, twice the slots; the next tile's S^T issued behind P V): the fp64 reference."""
    _need_hopper()
    _use_form(monkeypatch, form)
    inp, out, lse, _ = _decode(EDGES, s_q, h_q, 64)
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "serial", "ws-ahead", "rs", "rs2"])
@pytest.mark.parametrize("h_q,s_q", [(16, 3), (32, 2)])
def test_gpu_fp8_gluon_head_tiles(monkeypatch, form, h_q, s_q):
    """Past one head tile (48 and 64 rows, FP8_GLUON_MAX_ROWS 64): tiles of 32, each streaming
    every page of its part; the fp64 reference."""
    _need_hopper()
    _use_form(monkeypatch, form, max_rows=64)
    inp, out, lse, choice = _decode(EDGES, s_q, h_q, 64)
    assert choice.variant == "wgmma_fp8", choice
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "serial", "ws-ahead", "rs", "rs-s3", "rs2"])
def test_gpu_fp8_gluon_runs_of_splits_graph(monkeypatch, form):
    """An uneven batch of 40 (zeros, short and long requests): programs run several splits each,
    the ring and the K buffers carried from one split to the next; the same result from a CUDA
    graph replay as eagerly, and the fp64 reference."""
    _need_hopper()
    _use_form(monkeypatch, form)
    rng = random.Random(7)
    lens = [rng.choice([0, 1, 65, 300, 2000, 9000]) + rng.randint(0, 70) * (i % 3) for i in range(40)]
    inp, out, lse, _ = _decode(lens, 1, 16, 64, graph=True)
    _check_gpu(out, lse, inp, True)


def _spread_case(lens, h_q, seed):
    """A bf16 case (one query token) whose cached tokens' 128-value groups are scaled by powers of
    two in 2^-12 .. 2^6 (so group scales differ by up to 2^18 inside a tile and between groups), and
    its FP8 cache with NaN bytes in every unused slot."""
    inp = make_case(lens, 1, h_q, torch.bfloat16, "cuda", page_size=64, nan_tail=False)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spread = torch.exp2(torch.randint(-12, 7, inp.k_cache.shape[:-1] + (4,), generator=gen, device="cuda").float())
    latent = inp.k_cache.float()
    latent[..., :512] = (latent[..., :512].unflatten(-1, (4, 128)) * spread[..., None]).flatten(-2)
    inp.k_cache = latent.to(torch.bfloat16)
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache).cpu(), inp.block_table.cpu(), lens).cuda()
    return inp, packed


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "rs", "rs2"])
def test_gpu_fp8_gluon_scale_spread(monkeypatch, form):
    """Tokens whose magnitudes (and so group scales) differ by up to 2^18 inside one tile and from
    group to group: the register-operand form puts V's scales into P relative to each tile's
    largest and keeps each group's O^T in units of it; both forms against the fp64 reference."""
    _need_hopper()
    _use_form(monkeypatch, form)
    lens = [1000, 64, 4097, 333]
    inp, packed = _spread_case(lens, 16, seed=3)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1)
    out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                               causal=True, is_fp8_kvcache=True)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.bfloat16)
    _check_gpu(out, lse, inp, True)


def _use_wide(monkeypatch, from_rows: int = 1, pipeline: int | None = None) -> None:
    """The 64-row FP8 tiles (kernels_gluon_fp8_wide) from ``from_rows`` query rows (``pipeline``:
    the converter's form, else as shipped)."""
    monkeypatch.setattr(configs, "FP8_WIDE_FROM_ROWS", from_rows)
    if pipeline is not None:
        monkeypatch.setattr(configs, "FP8_GLUON_WIDE", dict(configs.FP8_GLUON_WIDE, PIPELINE=pipeline))
    configs.launch_config.cache_clear()
    op._plans.clear()


def test_fp8_wide_dispatch():
    """A bf16 q on the Gluon path takes the 64-row FP8 tiles from FP8_WIDE_FROM_ROWS rows and the
    transposed FP8 kernel below; an fp16 q never takes them (the cache's bf16 RoPE values and
    dequantized codes can exceed fp16's range); a pinned tl kernel stays pinned."""
    bf16 = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16)
    fp16 = bf16.half()
    wide = op._kernels().get("wgmma_fp8_wide") is not None
    for rows in (1, 32, 64, 65, 128, 512):
        got = op._fp8_variant("wgmma", rows, 256, bf16)
        if wide and rows >= configs.FP8_WIDE_FROM_ROWS:
            assert got == "wgmma_fp8_wide", rows
        else:
            assert got != "wgmma_fp8_wide", rows
        assert op._fp8_variant("wgmma", rows, 256, fp16) != "wgmma_fp8_wide", rows
    with tilefuse.force(variant="standard"):
        assert op._fp8_variant("standard", 128, 256, bf16) == "standard"
    cfg, fused, per_slot, _ = configs.launch_config("wgmma_fp8_wide", 128, 256)
    assert cfg == configs.FP8_GLUON_WIDE and not fused and per_slot == 1


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", [0, 1])
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("h_q,s_q,causal", [(128, 1, True), (64, 2, True), (16, 1, True), (5, 3, False),
                                            (128, 2, False), (1, 1, True)])
def test_gpu_fp8_wide(monkeypatch, page, h_q, s_q, causal, pipeline):
    """The 64-row FP8 tiles at 1-256 query rows (one to four head tiles, partial ones included),
    pages shorter than, equal to and longer than the 64-token K tile, lengths ending at every
    boundary, NaN bytes in every unused slot: the fp64 reference on the dequantized cache. Both
    converter forms (``PIPELINE``)."""
    _need_hopper()
    _use_wide(monkeypatch, pipeline=pipeline)
    inp, out, lse, choice = _decode(EDGES, s_q, h_q, page, causal)
    assert choice.variant == "wgmma_fp8_wide", choice
    _check_gpu(out, lse, inp, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", [0, 1])
def test_gpu_fp8_wide_runs_of_splits_graph(monkeypatch, pipeline):
    """An uneven batch of 40 at 128 heads: programs run several splits each, the K slots carried
    from one split to the next; a CUDA graph replay equals the eager call; the fp64 reference."""
    _need_hopper()
    _use_wide(monkeypatch, pipeline=pipeline)
    rng = random.Random(11)
    lens = [rng.choice([0, 1, 65, 300, 2000, 9000]) + rng.randint(0, 70) * (i % 3) for i in range(40)]
    inp, out, lse, choice = _decode(lens, 1, 128, 64, graph=True)
    assert choice.variant == "wgmma_fp8_wide", choice
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", [0, 1])
def test_gpu_fp8_wide_scale_spread(monkeypatch, pipeline):
    """Group scales that differ by up to 2^18 within a tile and between groups: each code times its
    own scale rounded to fp16; the fp64 reference."""
    _need_hopper()
    _use_wide(monkeypatch, pipeline=pipeline)
    lens = [1000, 64, 4097, 333]
    inp, packed = _spread_case(lens, 128, seed=5)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 128, 1)
    out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                               causal=True, is_fp8_kvcache=True)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.bfloat16)
    _check_bf16_p(out, lse, inp, lens)


def _check_bf16_p(out, lse, inp, lens):
    """The fp64 reference within the error of a P rounded to bf16 (the 16-bit path's products): each
    probability off by at most 2^-9 of itself moves an output by at most 2^-9 of the
    probability-weighted mean of |V| (computed here in fp64; 2^-8 of it for the fp32 sums' order
    too), plus the 1e-2 / 1e-2 of ``_check_gpu`` for the output's own bf16 rounding; lse and
    cos_diff as there. The spread scales make |V| up to 2^6 times the usual, so this term dominates.
    One query token per request (no causal limit inside it)."""
    from tilefuse.ops.mla.reference import HEAD_DIM, mla_decode_reference
    from tilefuse.testing.compare import assert_close, assert_within, cos_diff

    ro, rl = mla_decode_reference(*inp.args(), 512, causal=True, compute_dtype=torch.float64)
    weighted_abs = torch.zeros_like(ro)
    page = inp.k_cache.shape[1]
    for b, n in enumerate(lens):
        k = inp.k_cache[inp.block_table[b, : -(-n // page)].long()].reshape(-1, HEAD_DIM)[:n].double()
        p = torch.softmax(inp.q[b, 0].double() @ k.T * HEAD_DIM ** -0.5, dim=-1)
        weighted_abs[b, 0] = p @ k[:, :512].abs()
    assert cos_diff(out, ro) < 1e-5
    assert_within(out, ro, 1e-2 + 1e-2 * ro.abs() + 2.0 ** -8 * weighted_abs, "out: ")
    assert_close(lse, rl, atol=1e-3, rtol=1e-4, name="lse")
