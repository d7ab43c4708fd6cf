"""The Gluon 16-bit MLA kernel's transposed form (``kernels_gluon_t.mla_split_t_kernel``: cached
tokens as WGMMA's M, 16 or 32 query rows as N, one MMA warpgroup beside a TMA producer warp),
chosen up to ``configs.TRANSPOSED_GLUON_MAX_ROWS`` query rows where the Gluon kernel runs.

On the CPU: its switch and launch configs, the plan it makes, the ``TILEFUSE_CONFIGS`` key, and
its compile for sm_90a (no spills, shared memory, the unpadded WGMMAs). On Hopper: against the
fp64 reference (``tests/test_mla.py``'s tolerances) over lengths that end at every boundary (page,
K tile, split), NaN in every unwritten slot, pages of 16-128 tokens, 1-32 query rows, fp16 and
bf16, runs of splits per program and CUDA graph replays with new lengths."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import tilefuse
from tilefuse.ops.mla import configs, op
from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V
from tilefuse.testing.compare import captured
from tilefuse.testing.mla import make_case
from tests.test_mla import _check_gpu

SMEM_LIMIT = 227 * 1024


def _switch(monkeypatch, max_rows: int) -> None:
    monkeypatch.setattr(configs, "TRANSPOSED_GLUON_MAX_ROWS", max_rows)


def test_transposed_gluon_config_by_rows():
    """Rows pick the smallest tile that holds them (16 or 32); rows outside 1..32 are refused by name."""
    for rows in (1, 5, 16, 17, 24, 32):
        cfg = configs.transposed_gluon_config(rows)
        assert cfg["BLOCK_H"] == (16 if rows <= 16 else 32)
        assert cfg["BLOCK_N"] == 64 and cfg["STAGES"] == 2 and cfg["num_warps"] == 4
    for rows in (0, 33):
        with pytest.raises(ValueError, match="rows"):
            configs.transposed_gluon_config(rows)
    cfg, fused, per_slot, key = configs.launch_config("wgmma_t", 24, 64)
    assert cfg["BLOCK_H"] == 32 and not fused and per_slot == 1 and key == (tuple(sorted(cfg.items())), False, 1)


def test_transposed_gluon_switch(monkeypatch):
    """Off by default (0 rows); on, it takes 1..min(switch, 32) rows of a 16-bit cache, never an FP8
    cache, never past its largest tile."""
    assert configs.TRANSPOSED_GLUON_MAX_ROWS == 0 or "TILEFUSE_CONFIGS" in os.environ
    _switch(monkeypatch, 0)
    assert not any(configs.transposed_gluon(rows) for rows in (1, 16, 32))
    _switch(monkeypatch, 16)
    assert [configs.transposed_gluon(r) for r in (0, 1, 16, 17)] == [False, True, True, False]
    _switch(monkeypatch, 64)
    assert [configs.transposed_gluon(r) for r in (32, 33, 64)] == [True, False, False]
    assert not configs.transposed_gluon(16, fp8=True)


def test_transposed_gluon_plan(monkeypatch):
    """The plan of a Gluon call (made on the CPU: it reads shapes only) is the transposed kernel's
    where the switch takes the rows: one head tile of BLOCK_H rows per run of slots, the combine
    launch, the 64-row kernel's descriptors; 64-row tiles past it; the tl kernels untouched."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    inp = make_case([300, 70], 2, 12, torch.bfloat16, "cpu")
    meta, _ = op._metadata_torch(inp.cache_seqlens, 24)
    _switch(monkeypatch, 32)
    call = op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "wgmma")
    assert call.variant == "wgmma_t" and call.fallback is not None and call.fallback.variant == "standard"
    assert call.grid == (1, meta.shape[0] - 1, 1) and call.combine_grid == (2, 24, 1)
    assert call.meta["BLOCK_H"] == 32 and call.meta["BLOCK_N"] == 64 and call.meta["KV_PAGE"] == 64
    assert op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 1.0, True, "standard").variant == "standard"
    _switch(monkeypatch, 16)
    assert op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 1.0, True, "wgmma").variant == "wgmma"


def test_transposed_gluon_switch_from_configs_file(tmp_path):
    """``TILEFUSE_CONFIGS``' ``"mla"`` section sets the switch (``"wgmma_t_max_rows"``) for a run,
    without entering the kernels' config table."""
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"mla": {"wgmma_t_max_rows": 32}}))
    code = ("from tilefuse.ops.mla import configs; "
            "print(configs.TRANSPOSED_GLUON_MAX_ROWS, 'wgmma_t_max_rows' in configs.CONFIGS)")
    env = {**os.environ, "TILEFUSE_CONFIGS": str(path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["32", "False"]


@pytest.mark.parametrize("rows,page,dtype", [(16, 64, torch.bfloat16), (32, 64, torch.bfloat16),
                                             (32, 16, torch.bfloat16), (16, 128, torch.float16)],
                         ids=["h16", "h32", "h32-page16", "h16-page128-fp16"])
def test_mla_split_t_compiles(rows, page, dtype):
    """The kernel compiles for sm_90a at each launch: no spills, within the SM's shared memory
    (two 72 KB K buffers beside Q), TMA copies, warp-specialized, and one MMA warpgroup holding
    every row: WGMMAs of N = BLOCK_H, nothing padded to 64 rows."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from tilefuse.testing.gluon import compile_gluon_isolated, tensordesc

    cfg = configs.transposed_gluon_config(rows)
    box = min(page, cfg["BLOCK_N"])
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    signature = {"q_ptr": ptr, "kn_desc": tensordesc(dtype, [box, HEAD_DIM_V]),
                 "kr_desc": tensordesc(dtype, [box, HEAD_DIM - HEAD_DIM_V]), "bt_ptr": "*i32", "seqlens_ptr": "*i32",
                 "meta_ptr": "*i32", "splits_ptr": "*i32", "out_ptr": ptr, "lse_ptr": "*fp32", "oacc_ptr": "*fp32",
                 "lseacc_ptr": "*fp32"}
    signature.update({name: "i32" for name in ("batch", "h_q", "s_q", "rows_total", "num_slots", "num_blocks",
                                               "max_tokens")})
    signature["qk_scale"] = "fp32"
    signature.update({name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_btb", "stride_ob",
                                               "stride_os", "stride_oh", "stride_lb", "stride_lh")})
    constexprs = dict(CAUSAL=True, KV_PAGE=page, **cfg)
    signature.update({name: "constexpr" for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels_gluon_t:mla_split_t_kernel", signature, constexprs,
                                    num_warps=cfg["num_warps"],
                                    aligned=[name for name in signature if name.endswith("_ptr")])
    # 32 rows hold O^T in 128 registers a thread: Triton 3.6 fits them, Triton 3.9's allocator spills
    # 140 bytes of traffic at 255 registers (as it stands; the form is off by default); 16 rows: none
    assert result.spilled <= (160 if rows > 16 else 0), result.ptxas
    assert result.shared <= SMEM_LIMIT, result.shared
    assert 0 < result.registers <= 255
    assert "setmaxnreg" in result.ptx and "cp.async.bulk.tensor.2d" in result.ptx
    kind = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_H']}k16.f32.{kind}" in result.ptx
    assert "m64n64k16" not in result.ptx          # no 64-row (padded) products


# ----------------------------------------------------------------------------------------- GPU
# lengths ending at each boundary: 0, 1, pages of 16 / 32 (+-1), a K tile of 64 (+-1), and long
# ones that the schedule splits across programs
EDGES = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 777, 4000, 20000]


def _need_hopper():
    if not op.wgmma_usable(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper")


def _decode(inp, s_q, h_q, causal):
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens)
    out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=causal)
    return out, lse, choice


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, True), (8, 4, True), (24, 1, False), (5, 3, True), (1, 1, True),
                                            (32, 1, True), (16, 2, False)])
def test_gpu_wgmma_t_edges(monkeypatch, page, h_q, s_q, causal):
    """1-32 query rows (one head tile of 16 or 32, partial tiles included), pages shorter than,
    equal to and longer than a K tile, NaN in every unwritten slot: the fp64 reference."""
    _need_hopper()
    _switch(monkeypatch, 32)
    inp = make_case(EDGES, s_q, h_q, torch.bfloat16, "cuda", page_size=page)
    out, lse, choice = _decode(inp, s_q, h_q, causal)
    assert choice.variant == "wgmma_t", choice
    _check_gpu(out, lse, inp, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (16, 2), (32, 1), (1, 4)])
def test_gpu_wgmma_t_equal(monkeypatch, dtype, h_q, s_q):
    """Equal lengths (4113 tokens: not a multiple of a page), fp16 and bf16."""
    _need_hopper()
    _switch(monkeypatch, 32)
    inp = make_case([4096 + 17] * 8, s_q, h_q, dtype, "cuda")
    out, lse, choice = _decode(inp, s_q, h_q, True)
    assert choice.variant == "wgmma_t", choice
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (8, 4)])
def test_gpu_wgmma_t_runs_of_splits_graph(monkeypatch, h_q, s_q):
    """Long uneven batches (the parts schedule: programs run several splits, the K buffers carried
    from one split to the next) and short ones, captured once as metadata + attention and replayed
    with new lengths: each replay against the fp64 reference, and equal to an eager call."""
    _need_hopper()
    _switch(monkeypatch, 32)
    rng = random.Random(11)
    first = [70000] + [rng.randint(1, 20000) for _ in range(47)]      # runs of up to 4 splits per program
    inp = make_case(first, s_q, h_q, torch.bfloat16, "cuda", nan_tail=False)

    def step():
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)

    graph, (g_out, g_lse) = captured(step)
    zipf = [max(1, int(20000 / (i + 1) ** 1.1)) for i in range(48)]
    for lens in (first, zipf, [0] * 24 + [4097] * 24, [rng.randint(0, 70000) for _ in range(48)]):
        inp.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check_gpu(g_out, g_lse, inp, True)
        out, lse = step()
        assert torch.equal(out, g_out) and torch.equal(lse, g_lse)


@pytest.mark.gpu
def test_gpu_wgmma_t_off_by_default():
    """The shipped switch leaves the 64-row Gluon kernel in place at every row count."""
    _need_hopper()
    if configs.TRANSPOSED_GLUON_MAX_ROWS:
        pytest.skip("a run with the switch set (TILEFUSE_CONFIGS)")
    inp = make_case([300], 1, 16, torch.bfloat16, "cuda")
    _, _, choice = _decode(inp, 1, 16, True)
    assert choice.variant == "wgmma", choice


@pytest.mark.parametrize("tool", ["mla_wgmma_t_ab.py", "mla_perlayer_bench.py"])
def test_tools_help_without_a_gpu(tool):
    """The A/B and the per-layer bench tools parse their arguments without a GPU."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.join(root, "tools", tool), "--help"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_perlayer_bench_takes_the_dense_cases():
    """The per-layer run holds the quick grid's 16-bit dense cases (29, then 3 page sizes) and no
    FP8-cache or sparse case (building the cases touches no GPU)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    try:
        from mla_perlayer_bench import dense_cases
    finally:
        sys.path.pop(0)
    cases = dense_cases(torch.device("cuda"))
    assert len(cases) == 32
    assert all("kv" not in c.params and "topk" not in c.params for c in cases)
    assert [c.params.get("page") for c in cases[-3:]] == [16, 32, 128]
