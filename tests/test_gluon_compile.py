"""The Gluon (Hopper) kernels compile for sm_90a on the CPU with the arguments the ops launch them
with: no register spills, shared memory within the H200's 227 KB per block, and the warp
specialization and asynchronous WGMMA they are written for present in the PTX.

The GPU tests check their results; these catch a kernel that stops compiling, or starts spilling
or outgrows shared memory after a change, on a machine without a GPU. Each compiles in a child
process without the interpreter (``compile_gluon_isolated``), with the arguments specialized as
the launch specializes them (pointers and 16-divisible integers aligned).
"""

import re
import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from tilefuse.ops.mla import configs as mla_configs  # noqa: E402
from tilefuse.ops.mla import op as mla_op  # noqa: E402
from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V  # noqa: E402
from tilefuse.ops.swiglu import configs as swiglu_configs  # noqa: E402
from tilefuse.ops.swiglu_fp8 import configs as fp8_configs  # noqa: E402
from tilefuse.testing.gluon import compile_gluon_isolated, first_shared_store_offset, tensordesc  # noqa: E402

SMEM_LIMIT = 227 * 1024
CONSTEXPR = "constexpr"


def _check(result, max_registers=255, max_spilled=0):
    assert result.spilled <= max_spilled, result.ptxas
    assert result.shared <= SMEM_LIMIT, result.shared
    assert 0 < result.registers <= max_registers, result.ptxas
    assert "setmaxnreg" in result.ptx          # warp specialization: per-partition register budgets
    assert "wgmma.mma_async" in result.ptx and "wgmma.wait_group.sync.aligned" in result.ptx


# The Gluon MLA split kernels' scalar arguments (mla_split_ws_kernel, mla_split_fp8_kernel), in order.
MLA_SPLIT_SCALARS = {**{name: "i32" for name in ("batch", "h_q", "s_q", "rows_total", "num_slots", "num_blocks",
                                                 "max_tokens")},
                     "qk_scale": "fp32",
                     **{name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_btb", "stride_ob",
                                                 "stride_os", "stride_oh", "stride_lb", "stride_lh")}}


def _swiglu_pingpong(cfg, packed, dtype, bias):
    chunk = swiglu_configs.PACK if packed else cfg.block_n
    signature = {"x_desc": tensordesc(dtype, [cfg.block_m, cfg.block_k]),
                 "w_desc": tensordesc(dtype, [chunk, cfg.block_k]),
                 "out_desc": tensordesc(dtype, [cfg.block_m, cfg.block_n]),
                 "bias_ptr": "*bf16" if dtype == torch.bfloat16 else "*fp16", "M": "i32", "I": "i32", "H": "i32"}
    constexprs = dict(HAS_BIAS=bias, PACKED=packed, CHUNK=chunk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages, NUM_SMS=132, num_warps=4)
    signature.update({name: CONSTEXPR for name in constexprs})
    return compile_gluon_isolated("tilefuse.ops.swiglu.kernels_gluon:swiglu_pingpong_kernel", signature, constexprs,
                                  num_warps=4, aligned=["bias_ptr", "I", "H"])


@pytest.mark.parametrize("packed,dtype,bias,cfg", [
    (False, torch.bfloat16, True, swiglu_configs.PingPongConfig()),
    (True, torch.float16, False, swiglu_configs.PingPongConfig()),
    (False, torch.bfloat16, False, swiglu_configs.PingPongConfig(64, 128, 64, 8, 4)),
], ids=["merged-bf16-bias", "packed-fp16", "64x128"])
def test_swiglu_pingpong_compiles(packed, dtype, bias, cfg):
    result = _swiglu_pingpong(cfg, packed, dtype, bias)
    _check(result)
    # two consumer warpgroups, each issuing the gate and the up WGMMA of a K step
    assert result.ptx.count("wgmma.commit_group") >= 4
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in result.ptx     # TMA store of the output


def test_swiglu_pingpong_oversized_tile_spills():
    """The check above can fail: 128 x 128 output tiles (two 128 x 128 fp32 accumulators per
    warpgroup, 256 registers per thread) spill, which is why ``PingPongConfig`` refuses them."""
    big = object.__new__(swiglu_configs.PingPongConfig)
    for name, value in dict(block_m=128, block_n=128, block_k=64, group_m=8, stages=3).items():
        object.__setattr__(big, name, value)
    assert _swiglu_pingpong(big, False, torch.bfloat16, False).spilled > 0
    with pytest.raises(ValueError, match="block_m \\* block_n"):
        swiglu_configs.PingPongConfig(128, 128)


@pytest.mark.parametrize("ring,one_head,page,levers", [
    (None, False, 64, {}), ((32, 4), False, 64, {}), (None, True, 64, {}), (None, False, 16, {}), (None, False, 128, {}),
    (None, False, 64, dict(FUSED_SPLITS=16, Q_AHEAD=True, PDL=2)), (None, False, 64, dict(FUSED_SPLITS=1 << 20, PDL=1)),
    (None, False, 64, dict(FUSED_SPLITS=16, rows=16)), (None, False, 64, dict(FUSED_SPLITS=16, rows=32)),
    (None, False, 64, dict(SEESAW=1)), (None, False, 16, dict(SEESAW=1))],
    ids=["64x2", "32x4", "h1", "page16", "page128", "levers", "fused-all", "fused-16-rows", "fused-32-rows", "seesaw",
         "seesaw-page16"])
def test_mla_split_ws_compiles(ring, one_head, page, levers):
    """``one_head``: h_q = 1, which the launch specializes into a constant; ``page``: the cache's
    page size (below the tile: boxes of a page each; above: one box inside a page); ``levers``:
    the per-call levers of ``configs.WGMMA_LEVERS`` (the fused combine's merge at 16-64 rows)."""
    levers = dict(levers)
    rows = levers.pop("rows", 128)
    with mla_configs.wgmma_levers(**levers):
        cfg, _, _, _ = mla_configs.launch_config("wgmma", rows, 256)
    block_n, stages = ring or (cfg["BLOCK_N"], cfg["STAGES"])
    dtype = torch.bfloat16
    pointers = ["q_ptr", None, None, "bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr", "out_ptr", "lse_ptr",
                "oacc_ptr", "lseacc_ptr", "cnt_ptr"]
    box = min(page, block_n)
    types = ["*bf16", tensordesc(dtype, [box, HEAD_DIM_V]), tensordesc(dtype, [box, HEAD_DIM - HEAD_DIM_V]),
             "*i32", "*i32", "*i32", "*i32", "*bf16", "*fp32", "*fp32", "*fp32", "*i32"]
    names = ["q_ptr", "kn_desc", "kr_desc"] + pointers[3:]
    signature = dict(zip(names, types))
    signature.update(MLA_SPLIT_SCALARS)
    constexprs = dict(CAUSAL=True, BLOCK_N=block_n, STAGES=stages, KV_PAGE=page,
                      **{k: cfg[k] for k in (*mla_configs.WGMMA_LEVERS, "MERGE_ROWS")}, num_warps=cfg["num_warps"])
    if one_head:
        constexprs["h_q"] = 1
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon:mla_split_ws_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"], aligned=[n for n in names if n.endswith("_ptr")])
    # every lever at once (off as shipped): Triton 3.9 spills 12 bytes there (3.6: none), bounded;
    # the seesaw form (off: measured slower) holds a softmax in both MMA warpgroups: Triton 3.6 spills
    # 692 bytes of scalars there (3.9: none), bounded
    _check(result, max_spilled=1024 if levers.get("SEESAW") else 32 if levers.get("Q_AHEAD") else 0)
    # the levers are in the code only when on: the fused combine's acq_rel arrival, PDL's grid control
    assert ("atom.global.gpu.acq_rel.add" in result.ptx) == bool(cfg["FUSED_SPLITS"])
    assert ("griddepcontrol.wait" in result.ptx) == (cfg["PDL"] >= 2)
    assert ("griddepcontrol.launch_dependents" in result.ptx) == (cfg["PDL"] >= 1)


@pytest.mark.parametrize("block_n,quant,scaled_k", [(128, True, True), (128, False, False), (64, False, True)],
                         ids=["128-e4m3-block", "128-bf16-rowwise", "64-bf16-block"])
def test_swiglu_fp8_ws_compiles(block_n, quant, scaled_k):
    cfg = fp8_configs.WsConfig(block_n)
    fp8 = torch.float8_e4m3fn
    out = fp8 if quant else torch.bfloat16
    signature = {"x_desc": tensordesc(fp8, [128, 128]), "w_desc": tensordesc(fp8, [64, 128]),
                 "out_desc": tensordesc(out, [64, 64]), "xs_ptr": "*fp32", "ws_ptr": "*fp32", "os_ptr": "*fp32",
                 "M": "i32", "I": "i32", "K": "i32", "stride_xs_m": "i32", "stride_xs_k": "i32",
                 "stride_ws_n": "i32", "stride_ws_k": "i32", "stride_os_m": "i32"}
    constexprs = dict(X_GROUPED=scaled_k, W_BLOCKED=scaled_k, QUANT_OUT=quant, BLOCK_N=block_n,
                      GROUP_M=cfg.group_m, STAGES=cfg.stages, NUM_SMS=132, num_warps=4)
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.swiglu_fp8.kernels_gluon:swiglu_fp8_ws_kernel", signature,
                                    constexprs, num_warps=4, aligned=["xs_ptr", "ws_ptr", "os_ptr", "I", "K"])
    _check(result)
    assert "e4m3" in result.ptx          # FP8 WGMMA (e4m3 x e4m3)


VQ_POINTERS = ("x_ptr", "codes_ptr", "cb_ptr", "scales_ptr", "bias_ptr", "out_ptr", "ws_ptr", "cnt_ptr")


def _vq_signature(dtype, code_type, ints: dict):
    """The signature and the arguments the JIT marks 16-divisible (the pointers, and the integers
    whose launch values are), as a launch with ``ints``' values specializes them."""
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    types = (element, code_type, element, element, element, element, "*fp32", "*i32")
    aligned = list(VQ_POINTERS) + [name for name, value in ints.items() if value % 16 == 0]
    return {**dict(zip(VQ_POINTERS, types)), **{name: "i32" for name in ints}}, aligned


def _check_plain(result, max_spilled=0):
    """A kernel without warp specialization: no spills (or at most ``max_spilled`` bytes), shared
    memory within the block limit."""
    assert result.spilled <= max_spilled, result.ptxas
    assert result.shared <= SMEM_LIMIT, result.shared
    assert 0 < result.registers <= 255, result.ptxas


@pytest.mark.parametrize("m,dtype,ahead", [(1, torch.float16, None), (2, torch.bfloat16, None), (1, torch.float16, 3),
                                           (4, torch.float16, 4)],
                         ids=["1tok-fp16", "2tok-bf16", "1tok-ahead3", "4tok-ahead4"])
def test_vq_resident_decode_compiles(m, dtype, ahead):
    """The table decode at the 28672 x 8192 layer, its inline-PTX lookups included (they address
    Triton's ``global_smem`` symbol, which must be in the PTX), at the configured depth of code
    blocks in flight and at the deeper ones the sweep tries."""
    from tilefuse.ops.vq import configs as vq_configs

    n, k = 28672, 8192
    cfg = vq_configs.resident_config(m, n, k, 132)
    signature, aligned = _vq_signature(dtype, "*i32", dict(   # the values op._resident_call passes
        M=m, N=n, NUM_GROUPS=k // 8, ROWS_PER_PROG=cfg["rows_per_prog"], SPLIT_K=cfg["k_slices"], stride_xm=k,
        stride_cw=k // 16, stride_om=n))
    constexprs = dict(M_PAD=cfg["m_pad"], BLOCK_R=cfg["block_r"], AHEAD=ahead or cfg["ahead"], SPLIT=cfg["k_slices"] > 1,
                      HAS_BIAS=True, NUM_WARPS=cfg["num_warps"])
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.vq.kernels_resident:vq_decode_resident_kernel", signature,
                                    constexprs, num_warps=cfg["num_warps"], aligned=aligned)
    _check_plain(result)
    assert "global_smem" in result.ptx
    # the lookups read the table at global_smem + 0; the codebooks staged for its build lie past it
    assert first_shared_store_offset(result.ptx) == 2 * 256 * 64 * 4      # the table: 512 rows of 256 B


@pytest.mark.parametrize("m", [3, 16])
def test_vq_mma_decode_compiles(m):
    from tilefuse.ops.vq import configs as vq_configs

    n, k = 4096, 4096
    cfg = vq_configs.mma_config(m, n, k, "gluon", 132)
    signature, aligned = _vq_signature(torch.float16, "*i16", dict(   # the values op._mma_call passes
        M=m, N=n, NUM_GROUPS=k // 8, GROUPS_PER_SPLIT=cfg["groups_per_split"], SPLIT_K=cfg["split_k"], stride_xm=k,
        stride_cn=k // 8, stride_om=n))
    constexprs = dict(BLOCK_N=cfg["block_n"], TOKENS=cfg["tokens"], KREP=cfg["krep"], NUM_WARPS=cfg["num_warps"],
                      SPLIT=cfg["split_k"] > 1, HAS_BIAS=True, EVEN=cfg["even"])
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.vq.kernels_mma:vq_decode_mma_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"], aligned=aligned)
    _check_plain(result)
    assert "mma.sync" in result.ptx
    assert first_shared_store_offset(result.ptx) == 0      # the lookups read codebook 0 at global_smem + 0


def test_vq_gather_decode_compiles():
    """The gather decode (5-8 tokens when ``decode`` is forced, or K / 8 odd) at 11008 x 4096."""
    from tilefuse.ops.vq import configs as vq_configs

    m, n, k = 8, 11008, 4096
    cfg = vq_configs.gather_config(m, n, k, True, 132)
    signature, aligned = _vq_signature(torch.float16, "*i16", dict(   # the values op.launch_decode passes
        M=m, N=n, NUM_GROUPS=k // 8, GROUPS_PER_SPLIT=cfg["groups_per_split"],
        SPLIT_K=-(-(k // 8) // cfg["groups_per_split"]), stride_xm=k, stride_cn=k // 8, stride_om=n))
    constexprs = dict(BLOCK_N=cfg["block_n"], COLS=cfg["cols"], M_PAD=cfg["m_pad"],
                      SPLIT=k // 8 > cfg["groups_per_split"], HAS_BIAS=False, NUM_WARPS=cfg["num_warps"],
                      CONVERT_TABLE=cfg["convert_table"])
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.vq.kernels_gluon:vq_decode_gluon_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"], aligned=aligned)
    _check_plain(result, max_spilled=128)   # 8 tokens: 255 registers and 80 bytes of spill traffic, as it stands


@pytest.mark.parametrize("m,n,k,dtype,ws", [(512, 28672, 8192, torch.float16, 0), (512, 4096, 4096, torch.bfloat16, 0),
                                            (64, 4096, 4096, torch.float16, 0), (512, 28672, 8192, torch.bfloat16, 1),
                                            (64, 4096, 4096, torch.float16, 1)],
                         ids=["256tok-tile", "128tok-tile", "64tok-tile", "ws-256tok-tile", "ws-64tok-split"])
def test_vq_wgmma_prefill_compiles(m, n, k, dtype, ws):
    """The WGMMA prefill kernel with the tiles ``configs.wgmma_prefill_config`` picks: no spills,
    shared memory within the limit, WGMMA with the weight tile in registers, and the codebook
    copies stored at the offset its lookups' PTX reads (``_cb_base``: Triton's allocator order)."""
    from tilefuse.ops.vq import configs as vq_configs
    from tilefuse.ops.vq.kernels_prefill import _cb_base

    cfg = vq_configs.wgmma_prefill_config(m, n, k, 132, ws=ws)
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    signature = {"x_desc": tensordesc(dtype, [cfg["block_m"], 64]),
                 "c_desc": tensordesc(torch.int16, [cfg["block_n"], 8]), "cb_ptr": element, "scales_ptr": element, "bias_ptr": element, "out_ptr": element, "ws_ptr": "*fp32",
                 "cnt_ptr": "*i32", "M": "i32", "N": "i32", "NUM_GROUPS": "i32", "GROUPS_PER_SPLIT": "i32",
                 "SPLIT_K": "i32", "stride_om": "i32"}
    constexprs = vq_configs.wgmma_prefill_meta(cfg, has_bias=True)      # what op._prefill_call passes
    num_warps = constexprs.pop("num_warps")
    signature.update({name: CONSTEXPR for name in constexprs})
    kernel = "vq_prefill_ws_kernel" if ws else "vq_prefill_kernel"
    result = compile_gluon_isolated(f"tilefuse.ops.vq.kernels_prefill:{kernel}", signature, constexprs,
                                    num_warps=num_warps, aligned=["cb_ptr", "scales_ptr", "bias_ptr", "out_ptr", "N",
                                                                  "NUM_GROUPS", "stride_om"])
    if ws:
        _check(result)
    else:
        _check_plain(result)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(f16|bf16)\.(f16|bf16) \{[^}]*\}, \{",
                     result.ptx), "the A operand must come from registers"
    # one lookup pair per weight pair: 16 per tile, two tiles in the code (the first step, the loop) per
    # consumer; no shuffles but the warp-specialized dispatch's one broadcast of the warp index
    assert result.ptx.count("shfl") <= ws and result.ptx.count("ld.shared.b32 p, [a+") == 32 * (1 + ws)
    base = _cb_base(cfg["block_m"], cfg["stages"])
    assert first_shared_store_offset(result.ptx) == base
    assert f"[a+{base}]" in result.ptx and f"[b+{base + 128}]" in result.ptx


def _mla_tl_signature():
    sig = {name: ("*bf16" if name in ("q_ptr", "kc_ptr", "out_ptr") else "*fp32" if "acc" in name or name == "lse_ptr"
                  else "*i32")
           for name in ("q_ptr", "kc_ptr", "bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr", "out_ptr", "lse_ptr",
                        "oacc_ptr", "lseacc_ptr", "cnt_ptr")}
    sig.update({name: "i32" for name in ("batch", "h_q", "s_q", "rows_total", "num_slots", "num_blocks", "max_tokens")})
    sig["qk_scale"] = "fp32"
    sig.update({name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_kp", "stride_kt", "stride_btb",
                                         "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_lh")})
    return sig


@pytest.mark.parametrize("kernel,block_h", [("mla_split_standard_kernel", 64), ("mla_split_transposed_kernel", 32)])
@pytest.mark.parametrize("page,fp8", [(16, False), (128, False), (64, True), (16, True)])
def test_mla_tl_kernels_compile_for_every_page_size(kernel, block_h, page, fp8):
    """The tl split kernels compile for sm_90a with pages smaller than a KV tile (a page per
    token) and larger (a page per tile), on 16-bit caches and on the FP8 layout (bytes)."""
    constexprs = dict(CAUSAL=True, BLOCK_H=block_h, BLOCK_N=64, DOT_PREC="tf32", FUSED_COMBINE=False,
                      SLOT_PROGRAMS=1, KV_PAGE=page, KV_FP8=fp8)
    signature = {**_mla_tl_signature(), **{name: CONSTEXPR for name in constexprs}}
    if fp8:
        signature["kc_ptr"] = "*u8"
    result = compile_gluon_isolated(f"tilefuse.ops.mla.kernels:{kernel}", signature, constexprs, num_warps=8)
    assert result.shared <= SMEM_LIMIT and result.registers > 0


@pytest.mark.parametrize("variant,rows", [("standard", 128), ("standard", 32), ("transposed", 64), ("transposed", 32)])
def test_mla_tl_kernels_fit_shared_memory_with_fp32_q(variant, rows):
    """A float32 q and cache (accepted on a GPU; the tl kernels run them with fp32 dots) at the
    launch settings ``launch_config`` gives 4-byte elements fits the SM's shared memory: the 16-bit
    tiles would ask for 311-313 KB at 64 head rows."""
    cfg, fused, per_slot, _ = mla_configs.launch_config(variant, rows, 64, 4)
    cfg = dict(cfg)
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    constexprs = dict(CAUSAL=True, DOT_PREC="ieee", FUSED_COMBINE=fused, SLOT_PROGRAMS=per_slot, KV_PAGE=64,
                      KV_FP8=False, **cfg)
    signature = {**_mla_tl_signature(), "q_ptr": "*fp32", "kc_ptr": "*fp32", "out_ptr": "*fp32",
                 **{name: CONSTEXPR for name in constexprs}}
    result = compile_gluon_isolated(f"tilefuse.ops.mla.kernels:mla_split_{variant}_kernel", signature, constexprs,
                                    num_warps=num_warps, num_stages=num_stages)
    assert result.shared <= SMEM_LIMIT and result.registers > 0
    assert mla_configs.launch_config(variant, rows, 64)[0]["BLOCK_N"] > cfg["BLOCK_N"]  # 16-bit tiles unchanged


@pytest.mark.parametrize("h_q", [8, 16, 128])
def test_mla_sparse_gluon_kernel_compiles(h_q):
    """The Gluon sparse kernel compiles for sm_90a at each shipped launch (configs.GLUON_SPARSE_CONFIGS)
    with the largest index list (GLUON_SPARSE_INDEX_BYTES of int32): it fits the SM's shared memory
    (one program per SM), its gathers are 16-byte cp.async copies bypassing L1 (``.cg``), both
    products are WGMMAs, and spills stay small (at most 24 bytes measured), bounded so growth shows."""
    cfg = mla_configs.sparse_config(h_q, gluon=True)
    tiles = mla_configs.GLUON_SPARSE_INDEX_BYTES // 4 // 64
    constexprs = dict(BLOCK_H=cfg["BLOCK_H"], CHUNK=64 * tiles, IDX_TILES=tiles, HAS_LEN=True, STAGES=cfg["STAGES"],
                      NUM_WARPS=cfg["num_warps"])
    signature = {"q_ptr": "*bf16", "kc_ptr": "*i32", "idx_ptr": "*i32", "len_ptr": "*i32", "oacc_ptr": "*fp32",
                 "lseacc_ptr": "*fp32",
                 **{name: "i32" for name in ("h_q", "s_q", "topk", "num_tokens", "chunk_base", "num_chunks")},
                 "qk_scale": "fp32",
                 **{name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_ib", "stride_is")},
                 **{name: CONSTEXPR for name in constexprs}}
    aligned = [name for name in signature if name.endswith("_ptr") and name != "len_ptr" or name.startswith("stride")]
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon_sparse:mla_sparse_gluon_kernel", signature,
                                    constexprs, num_warps=cfg["num_warps"], aligned=aligned)
    assert result.shared <= SMEM_LIMIT and result.spilled <= 64
    assert "cp.async.cg.shared.global" in result.ptx and "wgmma.mma_async" in result.ptx


@pytest.mark.parametrize("block_h,fp8", [(16, True), (64, True), (64, False)])
def test_mla_sparse_kernels_compile(block_h, fp8):
    """The sparse decode's split kernel (gathered tokens, 16-bit or FP8 cache) and its combine
    compile for sm_90a; the split kernel's spills stay small (at most 16 bytes with Triton 3.6's
    ptxas, up to 488 with 3.9's CUDA 13 one at 64-head FP8 tiles), bounded so that growth shows."""
    cfg = mla_configs.sparse_config(block_h)
    constexprs = dict(BLOCK_H=block_h, BLOCK_N=cfg["BLOCK_N"], CHUNK=256, HAS_LEN=True, KV_FP8=fp8, DOT_PREC="tf32")
    signature = {"q_ptr": "*bf16", "kc_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32", "len_ptr": "*i32",
                 "oacc_ptr": "*fp32", "lseacc_ptr": "*fp32",
                 **{name: "i32" for name in ("h_q", "s_q", "topk", "num_tokens", "page", "chunk_base", "num_chunks")},
                 "qk_scale": "fp32",
                 **{name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_kp", "stride_kt",
                                             "stride_ib", "stride_is")},
                 **{name: CONSTEXPR for name in constexprs}}
    # pointers and strides as the launcher specializes them (multiples of 16: 656-byte and
    # 576-element rows)
    aligned = [name for name in signature if name.endswith("_ptr") and name != "len_ptr" or name.startswith("stride")]
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels:mla_sparse_split_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"], aligned=aligned, num_stages=cfg["num_stages"])
    assert result.shared <= SMEM_LIMIT and result.registers > 0 and result.spilled <= 512
    constexprs = dict(HAS_SINK=True, S_CHUNK=8)
    signature = {"oacc_ptr": "*fp32", "lseacc_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                 "lse_ptr": "*fp32", **{name: "i32" for name in ("h_q", "s_q", "num_chunks", "stride_ob", "stride_os",
                                                                  "stride_oh", "stride_lb", "stride_lh")},
                 **{name: CONSTEXPR for name in constexprs}}
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels:mla_sparse_combine_kernel", signature, constexprs,
                                    num_warps=4)
    assert result.registers > 0 and result.spilled == 0


def test_mla_metadata_kernel_compiles():
    """The metadata kernel (one program: a data-dependent bisection, the chunk candidates, the
    work line and the pick) compiles for sm_90a."""
    from tilefuse.ops.mla.op import metadata_constexprs

    constexprs = metadata_constexprs(256, 32)
    signature = {"seqlens_ptr": "*i32", "meta_ptr": "*i32", "num_splits_ptr": "*i32", "starts_ptr": "*i32",
                 "batch": "i32", "num_parts": "i32", "num_slots": "i32", **{name: CONSTEXPR for name in constexprs}}
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels:mla_metadata_kernel", signature, constexprs, num_warps=4)
    assert result.registers > 0 and result.spilled == 0


def test_child_failure_reports_the_exception():
    """A kernel that fails to compile in the child process is reported by its exception (type and
    message), not by the tail of the child's stderr."""
    with pytest.raises(RuntimeError, match=r"ModuleNotFoundError: No module named 'tilefuse\.no_such_module'"):
        compile_gluon_isolated("tilefuse.no_such_module:kernel", {"x_ptr": "*fp16"}, {}, num_warps=4)
    with pytest.raises(RuntimeError, match=r"AttributeError: .*no_such_kernel"):
        compile_gluon_isolated("tilefuse.ops.gluon_common:no_such_kernel", {"x_ptr": "*fp16"}, {}, num_warps=4)


@pytest.mark.parametrize("form", ["ws", "serial"])
@pytest.mark.parametrize("rows,page", [(16, 64), (32, 64), (32, 16), (16, 128)],
                         ids=["h16", "h32", "h32-page16", "h16-page128"])
def test_mla_split_fp8_compiles(rows, page, form):
    """The Gluon dense FP8 kernel compiles for sm_90a in both forms at each launch
    (``configs.FP8_GLUON_WS`` / ``FP8_GLUON_SERIAL`` by rows; the default takes one of them):
    within the SM's shared memory, TMA copies and WGMMAs, warp-specialized, the e4m3 -> fp16
    conversion two codes at a time. No spills, except the warp-specialized form at 32 rows: its
    MMA warpgroup holds O^T in 128 of its 256 registers, and ptxas keeps a few of the split's
    scalars (request, partial index, strides: at most 40 words) in local memory across the tile
    loop, stored and reloaded once per split (SASS: no local access between the tile loop's
    barrier wait and its last WGMMA)."""
    table = mla_configs.FP8_GLUON_WS if form == "ws" else mla_configs.FP8_GLUON_SERIAL
    cfg = dict(table[rows])
    box = min(page, cfg.get("SLOT_N", 64))
    pointers = ["q_ptr", "bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr", "out_ptr", "lse_ptr", "oacc_ptr",
                "lseacc_ptr"]
    signature = {"q_ptr": "*bf16", "codes_desc": tensordesc(torch.float8_e4m3fn, [box, 128]),
                 "scales_desc": tensordesc(torch.float32, [box, 4]), "bt_ptr": "*i32", "seqlens_ptr": "*i32",
                 "meta_ptr": "*i32", "splits_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "oacc_ptr": "*fp32", "lseacc_ptr": "*fp32"}
    signature.update(MLA_SPLIT_SCALARS)
    constexprs = dict(CAUSAL=True, KV_PAGE=page, **cfg)
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon_fp8:mla_split_fp8_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"], aligned=pointers)
    _check(result, max_spilled=160 if form == "ws" and cfg["BLOCK_H"] == 32 else 0)
    assert "cp.async.bulk.tensor.2d" in result.ptx          # TMA copies of the pages
    assert "cvt.rn.f16x2.e4m3x2" in result.ptx             # two codes per conversion
    if form == "ws":      # one MMA warpgroup holds every row: N = BLOCK_H
        assert f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_H']}k16.f32.f16.f16" in result.ptx


@pytest.mark.parametrize("page,pipeline", [(16, 0), (64, 0), (256, 0), (64, 1), (16, 1)])
def test_mla_split_fp8_wide_compiles(page, pipeline):
    """The Gluon dense FP8 kernel's 64-row tiles (``kernels_gluon_fp8_wide``,
    ``configs.FP8_GLUON_WIDE``; ``pipeline``: the converter's form) compile for sm_90a within the
    SM's shared memory (Q and two 16-bit K slots, no raw-code ring), warp-specialized with the
    configured register budgets, the converter's loads 16 bytes wide (4 groups of codes and the
    RoPE values: 20 per thread per tile, beside Q's 32), two codes per conversion straight to fp16
    (64 x 512 codes over 128 threads: 128; none through fp32), the 16-bit kernel's WGMMAs (fp16
    codes, bf16 RoPE), the L2 prefetches of a tile ahead. Spills: the default form at most 64 bytes
    (8-54 measured with Triton 3.6-3.9: the budgets' split with the fewest; every other split of
    504 registers spills more); the pipelined one (off) at most 320 (32 with Triton 3.9, 236-252
    with 3.6)."""
    cfg = dict(mla_configs.FP8_GLUON_WIDE, PIPELINE=pipeline)
    pointers = ["q_ptr", "cache_ptr", "bt_ptr", "seqlens_ptr", "meta_ptr", "splits_ptr", "out_ptr", "lse_ptr",
                "oacc_ptr", "lseacc_ptr"]
    types = ["*bf16", "*u8", "*i32", "*i32", "*i32", "*i32", "*bf16", "*fp32", "*fp32", "*fp32"]
    signature = dict(zip(pointers, types))
    signature.update(MLA_SPLIT_SCALARS)
    constexprs = dict(CAUSAL=True, KV_PAGE=page, **cfg)
    signature.update({name: CONSTEXPR for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon_fp8_wide:mla_split_fp8_wide_kernel", signature,
                                    constexprs, num_warps=cfg["num_warps"], aligned=pointers)
    _check(result, max_spilled=320 if pipeline else 64)
    ptx = result.ptx
    assert ("prefetch.global.L2" in ptx) == bool(cfg["PREFETCH"])
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{cfg['PV_REGS']};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{cfg['CONVERTER_REGS']};" in ptx
    # the pipelined form: the split's first tile before the loop, each next one in it (4 scales in
    # one load each time)
    assert ptx.count("ld.global.v4.b32") == (20 + 32 if not pipeline else 2 * 21 + 32)
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 128 and "cvt.f32.f16" not in ptx
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in ptx              # S = Q K^T, codes
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx            # S = Q K^T, RoPE
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx             # each half of P V
    assert "griddepcontrol.launch_dependents" in ptx                                # PDL for the combine
