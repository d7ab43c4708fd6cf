"""2-bit MoE experts (``tilefuse.vq_moe``, ``tilefuse/ops/vq/kernels_moe.py``, ``tilefuse.nn.VQMoEExperts``).

CPU: the ``tl`` twins in Triton's interpreter (fp16: the interpreter computes bf16 ``tl.dot``
wrongly) at small shapes that cross K steps and slices, H/8 odd, one expert, repeated experts in
a token, many tokens per expert, into NaN-poisoned outputs; out-of-range expert ids; no tokens,
no slots; the fp32 reference; bad inputs; the fake; the Gluon kernels compiled for sm_90; the
module and ``patch_vq`` on a tiny Qwen3-MoE model. GPU (@gpu): the Gluon kernels at Qwen3-30B-A3B's
and a held-out expert shape, fp16 and bf16, settings, bit-identical repeats and graph replays.

Tolerance (``tilefuse.testing.vq.moe_bound``, checked by ``check_moe``), against the spec in fp64 (``vq_moe_reference`` with h unrounded): per
token-expert pair, the gate/up as ``vq_swiglu``'s fused kernel (``tests/test_vq_swiglu.py``: each
projection within ``s = tolerance(dtype, "small")["scale"]`` times ``|x| @ |W|^T``, SiLU's slope
below 1.1, one rounding of h to x's dtype: ``e_h``); the down projection of the rounded h moves by
``e_h @ |Wd|^T`` plus its own ``s * (|h| + e_h) @ |Wd|^T``, times ``|w|``; the fp32 sum over the k
slots adds ``2^-20 * sum |y_p|`` (k <= 8 fp32 additions) and the output's rounding one ulp of ``|y|``.
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.vq import op as vq_op
from tilefuse.testing import poisoned, repeats_and_replays_identical
from tilefuse.testing.vq import MOE_SHAPES, make_moe_case, moe_reference_fp64
from tilefuse.testing.vq import check_moe as _check

def _run(case, impl="auto", gate_up=None, down=None, grouped=None):
    """The launches into a NaN-poisoned output (``grouped``: tiles of one expert's tokens, None: the
    op's choice)."""
    (t, h), k = case.x.shape, case.top_k_index.shape[1]
    e, i = case.gate_up_codes.shape[0], case.gate_up_codes.shape[1] // 2
    call = vq_op._moe_plan(t, k, e, h, i, case.x.device, impl, gate_up, down, grouped)
    assert grouped is None or call.grouped == grouped
    out = poisoned((t, h), case.x.dtype, case.x.device)
    return vq_op.launch_moe(call, *case.args(), out)


# (T, k, E, H, I): K steps and slices crossed, H/8 odd (72 -> 9), I/8 odd (24 -> 3), one group
# (8), k = 1, many tokens per expert (E = 2)
CPU_SHAPES = [(3, 2, 4, 64, 40), (5, 3, 3, 72, 24), (1, 1, 2, 8, 8), (6, 2, 2, 32, 16)]


@pytest.mark.parametrize("t,k,e,h,i", CPU_SHAPES)
def test_moe_interpreted(interpret, t, k, e, h, i):
    case = make_moe_case(t, k, e, h, i, torch.float16, interpret)
    _check(_run(case, grouped=False), case)


# (T, k, E, H, I, distinct): two tiles of 16 for an expert (20 pairs each), repeated experts
# (k > E), an expert without tokens, one token
GROUPED_SHAPES = [(20, 2, 2, 32, 16, True), (9, 3, 2, 72, 24, False), (5, 2, 4, 64, 40, True), (1, 1, 2, 8, 8, True)]


@pytest.mark.parametrize("t,k,e,h,i,distinct", GROUPED_SHAPES)
def test_moe_grouped_interpreted(interpret, t, k, e, h, i, distinct):
    """Tiles of one expert's tokens (the schedule sorted on the device), out-of-range ids in none."""
    case = make_moe_case(t, k, e, h, i, torch.float16, interpret, distinct=distinct)
    case.top_k_index[0, 0] = e
    if t > 2:
        case.top_k_index[2, -1] = -1
    _check(_run(case, grouped=True), case)


def _run_dequant(case):
    """The dequantize + grouped GEMM path into a NaN-poisoned output."""
    (t, h), k = case.x.shape, case.top_k_index.shape[1]
    e, i = case.gate_up_codes.shape[0], case.gate_up_codes.shape[1] // 2
    call = vq_op._moe_plan(t, k, e, h, i, case.x.device, dequant=True)
    assert call.dequant
    out = poisoned((t, h), case.x.dtype, case.x.device)
    return vq_op.launch_moe_dequant(call, *case.args(), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,h,i,distinct", GROUPED_SHAPES)
def test_moe_dequant_path_interpreted(interpret, dtype, t, k, e, h, i, distinct):
    """The dequantize path (every expert dequantized by ``vq_moe_dequant_kernel``, PyTorch's grouped
    GEMM over the expert-sorted pairs, the slot sum): within the dequantize tolerance of the fp64
    spec (``moe_bound(case, "dequant")``), out-of-range ids contribute nothing, int8 codes read as
    the same bits. bf16 is exact in the interpreter here (no ``tl.dot`` in the kernel)."""
    from tilefuse.testing.vq import check_moe

    case = make_moe_case(t, k, e, h, i, dtype, interpret, distinct=distinct)
    case.top_k_index[0, 0] = e
    if t > 2:
        case.top_k_index[2, -1] = -1
    check_moe(_run_dequant(case), case, "dequant")
    case.gate_up_codes, case.down_codes = case.gate_up_codes.view(torch.int8), case.down_codes.view(torch.int8)
    check_moe(_run_dequant(case), case, "dequant")


def test_moe_dequant_path_is_picked_from_its_threshold(interpret, monkeypatch):
    """``configs.MOE["dequant_pairs"]``: from that many pairs on (0: never); the op's output then
    is the dequantize path's."""
    from tilefuse.ops.vq import configs
    from tilefuse.testing.vq import check_moe

    monkeypatch.setitem(configs.MOE, "dequant_pairs", 0)
    assert not vq_op._moe_plan(500, 8, 4, 64, 32, torch.device(interpret)).dequant
    monkeypatch.setitem(configs.MOE, "dequant_pairs", 12)
    assert not vq_op._moe_plan(5, 2, 4, 64, 32, torch.device(interpret)).dequant
    assert vq_op._moe_plan(6, 2, 4, 64, 32, torch.device(interpret)).dequant
    # never for fp16 on a GPU: PyTorch's fp16 grouped GEMM reads its offsets on the host there
    assert vq_op._grouped_mm_syncs(torch.float16, torch.device("cuda"))
    assert not vq_op._grouped_mm_syncs(torch.bfloat16, torch.device("cuda"))
    assert not vq_op._grouped_mm_syncs(torch.float16, torch.device("cpu"))
    case = make_moe_case(6, 2, 4, 64, 32, torch.float16, interpret)
    vq_op._moe_plans.clear()
    try:
        check_moe(tilefuse.vq_moe(*case.args()), case, "dequant")
        assert "dequant" in str(tilefuse.explain(tilefuse.vq_moe, *case.args()))
    finally:
        vq_op._moe_plans.clear()


def test_grouping_picks_the_faster_programs_of_the_committed_sweep():
    """``configs.MOE["group_pairs"]`` on every shape and token count of the committed H100 run
    (``tools/vq_moe_bench.py``: a program per pair and grouped tiles, both forced, graph replay):
    the path the op picks is the faster one (5 %: noise between rows)."""
    import json
    from pathlib import Path

    from tilefuse.ops.vq import configs

    path = Path(__file__).resolve().parents[1] / "bench/results/sweeps/vq-moe-h100-80gb-hbm3-quick.json"
    times = {}
    for row in json.loads(path.read_text())["rows"]:
        if row["impl"] in ("vq2:per_pair", "vq2:grouped") and row.get("graph_us"):
            times.setdefault((row["shape"], row["tokens"] * row["top_k"]), {})[row["impl"][4:]] = row["graph_us"]
    assert len(times) == 14
    for (shape, pairs), t in times.items():
        picked, other = ("grouped", "per_pair") if pairs >= configs.MOE["group_pairs"] else ("per_pair", "grouped")
        assert t[picked] <= 1.05 * t[other], (shape, pairs, t)


def test_moe_schedule_tiles_every_valid_pair_once():
    """``moe_schedule``: pairs sorted by expert (token order within), tiles of at most ``tokens``
    pairs of one expert covering every in-range pair once, empty tiles (expert E, no pairs) last;
    the tile bound ``moe_tiles`` holds."""
    gen = torch.Generator().manual_seed(0)
    for t, k, e, tokens in ((37, 8, 16, 8), (5, 2, 64, 8), (64, 6, 4, 16), (1, 1, 1, 8)):
        index = torch.randint(-1, e + 1, (t, k), generator=gen)
        tiles = vq_op.moe_tiles(t * k, e, tokens)
        sched, tok, pairs = vq_op.moe_schedule(index, e, tokens, tiles)
        expert, first, count = sched.view(3, tiles).long()
        flat = index.reshape(-1)
        covered = []
        for n in range(tiles):
            chunk = pairs[first[n]:first[n] + count[n]].long()
            assert 0 <= count[n] <= tokens and (count[n] == 0) == (expert[n] == e)
            assert bool((flat[chunk] == expert[n]).all()) and torch.equal(tok[first[n]:first[n] + count[n]].long(),
                                                                          chunk // k)
            assert torch.equal(chunk, chunk.sort().values)          # token order within an expert
            covered += chunk.tolist()
        valid = ((flat >= 0) & (flat < e)).nonzero().flatten().tolist()
        assert sorted(covered) == valid
        assert (expert[:-1] <= expert[1:]).all()


def _schedule_kernel(index, e, tokens, block=None):
    """``op.moe_schedule_launch`` (the one-program kernel) on ``index`` [T, k]; ``block``: its pairs
    per step (None: ``configs.moe_schedule_meta``'s; at least one per thread, as it picks)."""
    from tilefuse.ops.vq import configs

    tiles = vq_op.moe_tiles(index.numel(), e, tokens)
    meta = configs.moe_schedule_meta(index.numel(), e)
    if block is not None:
        meta = dict(meta, BLOCK=block, num_warps=min(meta["num_warps"], block // 32))
    return tiles, vq_op.moe_schedule_launch(index, e, tokens, tiles, meta)


def _schedule_cases(gen, big):
    """(name, index [T, k], E, tokens, block: the kernel's pairs per step, None: its default):
    random ids with out-of-range ones (-1, E, far outside), int64 and int32, all pairs on one
    expert, E = 1, ids only out of range, one pair; tile sizes 1-16; P not a multiple of the block."""
    sizes = [(16384, 8, 128, 8, None), (16384, 8, 512, 16, None), (4096, 6, 64, 8, None), (777, 8, 512, 8, 256)] \
        if big else [(250, 8, 128, 8, None), (37, 8, 16, 8, 128), (60, 6, 512, 16, 256), (5, 2, 64, 3, None)]
    for n, (t, k, e, tokens, block) in enumerate(sizes):
        index = torch.randint(-2, e + 2, (t, k), generator=gen)
        index[0, 0], index[-1, -1] = 2 ** 40, -(2 ** 40)
        if big or n != 1:
            yield "random", index, e, tokens, block
        if big or n in (1, 3):
            yield "random int32", index.clamp(-(2 ** 31), 2 ** 31 - 1).to(torch.int32), e, tokens, block
    t, k = (16384, 8) if big else (40, 8)
    skewed = torch.full((t, k), 5)
    skewed[::7, 3] = 9
    yield "one expert", skewed, 128, 8, None if big else 128
    yield "all on one expert", torch.full((t, k), 3), 4, 16, None
    yield "E = 1", torch.randint(-1, 2, (t, k), generator=gen), 1, 16, None
    yield "none in range", torch.full((3, 2), -1), 4, 8, None
    yield "one pair", torch.tensor([[0]]), 1, 1, None


def _check_schedule(index, e, tokens, block, name):
    tiles, got = _schedule_kernel(index, e, tokens, block)
    want = vq_op.moe_schedule(index, e, tokens, tiles)
    for what, a, b in zip(("schedule", "tokens", "pairs"), got, want):
        assert a.dtype == torch.int32 and torch.equal(a, b), (name, tuple(index.shape), e, tokens, block, what)


def test_moe_schedule_kernel_is_bit_identical_to_the_torch_schedule(interpret):
    """The schedule kernel's three outputs equal ``moe_schedule``'s bit for bit (the same stable
    order) on :func:`_schedule_cases` (up to 2000 pairs here; the GPU test goes to 16384 x 8)."""
    gen = torch.Generator().manual_seed(1)
    for name, index, e, tokens, block in _schedule_cases(gen, big=False):
        _check_schedule(index.to(interpret), e, tokens, block, name)


def test_moe_schedule_switch_and_expert_bound(monkeypatch):
    """``configs.MOE["schedule_kernel"]`` picks the kernel (default) or the PyTorch ops; more
    experts than the kernel's bins take the PyTorch ops."""
    from tilefuse.ops.vq import configs

    assert configs.MOE["schedule_kernel"] == 1
    meta = configs.moe_schedule_meta(200, 512)
    assert meta["EXPERTS"] == 1024 and meta["LOG_EXPERTS"] == 10 and meta["BLOCK"] == 256 and meta["num_warps"] == 8
    assert configs.moe_schedule_meta(16384 * 8, 1)["BLOCK"] == configs.MOE["schedule_block"]
    assert configs.moe_schedule_meta(3, 1) == dict(EXPERTS=32, LOG_EXPERTS=5, BLOCK=128, num_warps=4)
    assert configs.moe_schedule_meta(200, configs.MOE_SCHEDULE_BINS) is None
    assert vq_op._moe_plan(40, 8, 16, 64, 16, torch.device("cpu"), "tl", grouped=True).schedule is not None
    monkeypatch.setitem(configs.MOE, "schedule_kernel", 0)
    assert configs.moe_schedule_meta(200, 16) is None
    assert vq_op._moe_plan(40, 8, 16, 64, 16, torch.device("cpu"), "tl", grouped=True).schedule is None


def test_moe_grouped_torch_schedule_interpreted(interpret, monkeypatch):
    """The grouped programs on the PyTorch schedule (``schedule_kernel`` 0) as on the kernel's."""
    from tilefuse.ops.vq import configs

    case = make_moe_case(20, 2, 2, 32, 16, torch.float16, interpret)
    case.top_k_index[0, 0] = 2
    kernel = _run(case, grouped=True)
    monkeypatch.setitem(configs.MOE, "schedule_kernel", 0)
    torch_schedule = _run(case, grouped=True)
    _check(torch_schedule, case)
    assert torch.equal(kernel, torch_schedule)


def test_moe_grouped_op_under_torch_compile(interpret, monkeypatch):
    """The public op with tiles (``group_pairs`` lowered: 40 pairs) under
    ``torch.compile(fullgraph=True)``: the schedule launch runs inside the custom op."""
    from tilefuse.ops.vq import configs

    monkeypatch.setitem(configs.MOE, "group_pairs", 8)
    monkeypatch.setattr(vq_op, "_moe_plans", vq_op.PlanCache())
    case = make_moe_case(20, 2, 3, 32, 16, torch.float16, interpret)
    case.top_k_index[1, 0] = -1
    assert vq_op._plan_moe(case.x, *case.args()[1:]).grouped
    torch._dynamo.reset()
    backend = "inductor" if interpret.type == "cuda" else "aot_eager"
    with torch.no_grad():
        _check(torch.compile(tilefuse.vq_moe, fullgraph=True, backend=backend)(*case.args()), case)


def test_moe_settings_int8_codes_int32_ids_repeated_experts(interpret):
    """Repeated experts in one token (k > E), int8 codes, int32 ids, fp32 routing weights; explicit
    slices and row tiles; per pair and grouped."""
    case = make_moe_case(3, 3, 2, 72, 32, torch.float16, interpret, codes_dtype=torch.int8,
                         index_dtype=torch.int32, distinct=False)
    case.top_k_index[0] = torch.tensor([1, 1, 0], dtype=torch.int32)
    case.top_k_weights = case.top_k_weights.float()
    for grouped in (False, True):
        _check(_run(case, gate_up=dict(slices=4), down=dict(slices=2, row_tiles=2), grouped=grouped), case)


def test_moe_public_op_out_of_range_ids_contribute_nothing(interpret):
    """Ids -1 and E (transformers' expert-parallel sentinel) are skipped (the spec's rule), on the
    device, without a sync; check_contents=True reads them and refuses."""
    case = make_moe_case(4, 2, 3, 64, 16, torch.float16, interpret)
    case.top_k_index[0, 1] = 3
    case.top_k_index[2] = torch.tensor([-1, 7])
    out = tilefuse.vq_moe(*case.args())
    _check(out, case)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    with pytest.raises(ValueError, match=r"^top_k_index: expected expert ids in \[0, 3\)"):
        tilefuse.vq_moe(*case.args(), check_contents=True)


def test_moe_no_tokens_no_slots_and_nan_in_x(interpret):
    case = make_moe_case(3, 2, 2, 32, 16, torch.float16, interpret)
    args = list(case.args(case.x[:0]))
    args[1], args[2] = case.top_k_index[:0], case.top_k_weights[:0]
    empty = tilefuse.vq_moe(*args)
    assert empty.shape == (0, 32) and empty.dtype == torch.float16
    args = list(case.args())
    args[1], args[2] = case.top_k_index[:, :0], case.top_k_weights[:, :0]
    assert torch.equal(tilefuse.vq_moe(*args), torch.zeros(3, 32, dtype=torch.float16))
    case.x[1, 3] = float("nan")
    out = tilefuse.vq_moe(*case.args())
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


def test_moe_fp32_and_reference_backend():
    """fp32 x runs the spec (fp32 compute); the reference backend runs it for fp16 (h rounded to fp16)."""
    case = make_moe_case(4, 2, 3, 32, 16, torch.float32, "cpu")
    out = tilefuse.vq_moe(*case.args())
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), moe_reference_fp64(case), rtol=1e-5, atol=1e-6)
    half = make_moe_case(3, 2, 3, 32, 16, torch.float16, "cpu")
    with tilefuse.force(backend="reference"):
        _check(tilefuse.vq_moe(*half.args()), half)


def test_moe_no_backward(interpret):
    case = make_moe_case(2, 1, 2, 16, 8, torch.float16, interpret)
    x = case.x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward"):
        tilefuse.vq_moe(*case.args(x)).sum().backward()


# ------------------------------------------------------------------------------------- bad input
NAMES = ("x", "top_k_index", "top_k_weights", "gate_up_codes", "gate_up_codebooks", "gate_up_scales", "down_codes",
         "down_codebooks", "down_scales")


@pytest.mark.parametrize("name,make", [
    ("x", lambda c: c.x.to(torch.int32)),
    ("x", lambda c: c.x[:, :60]),                                 # H not a multiple of 8
    ("x", lambda c: c.x[None]),
    ("top_k_index", lambda c: c.top_k_index.float()),
    ("top_k_index", lambda c: c.top_k_index[:2]),
    ("top_k_weights", lambda c: c.top_k_weights[:, :1]),
    ("top_k_weights", lambda c: c.top_k_weights.to(torch.int64)),
    ("gate_up_codes", lambda c: c.gate_up_codes[:, :30]),          # 2I = 30: I not a multiple of 8
    ("gate_up_codes", lambda c: c.gate_up_codes[:, :, :4]),
    ("gate_up_codes", lambda c: c.gate_up_codes.to(torch.int32)),
    ("gate_up_codebooks", lambda c: c.gate_up_codebooks[:2]),
    ("gate_up_scales", lambda c: c.gate_up_scales[:, :8]),
    ("down_codes", lambda c: c.down_codes[:, :, :1]),
    ("down_codebooks", lambda c: c.down_codebooks.reshape(3, 2, 256, 8)),
    ("down_scales", lambda c: c.down_scales.to(torch.int32)),
    ("down_scales", lambda c: c.down_scales.to("meta")),           # another device
    ("gate_up_codebooks", lambda c: [0.0] * 4096),
])
def test_moe_bad_input_names_the_argument(name, make):
    case = make_moe_case(3, 2, 3, 64, 16, torch.float16, "cpu")
    args = dict(zip(NAMES, case.args()))
    args[name] = make(case)
    with pytest.raises(ValueError, match=f"^{name}: "):
        tilefuse.vq_moe(**args)


def test_moe_is_a_registered_op_with_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_moe_case(3, 2, 3, 64, 16, torch.float16, "cpu")
    with FakeTensorMode() as mode:
        out = torch.ops.tilefuse.vq_moe(*(mode.from_tensor(t) for t in case.args()))
    assert out.shape == (3, 64) and out.dtype == torch.float16


# ------------------------------------------------------------------------------------- module
def _tiny_qwen3_moe(layers=1):
    from transformers import Qwen3MoeConfig

    from tilefuse.bench.hf_models import random_model

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=256)
    return random_model(config, torch.device("cpu"), torch.float32)


def test_module_from_experts_and_patch_vq(interpret):
    """VQMoEExperts replaces a Qwen3MoeExperts (found by its form); its forward is the op on its
    buffers; patch_vq swaps every experts module with random codes, keeps the router, and the
    model runs; calibrated experts are refused clearly when asked for (the default keeps them dense
    under calibration); experts=False keeps them dense."""
    from tilefuse.hf import patch_vq
    from tilefuse.nn import VQMoEExperts
    from tilefuse.nn.vq_moe import unsupported_experts

    model = _tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    assert unsupported_experts(experts) is None
    assert "gate_up_proj" in unsupported_experts(model.model.layers[0].mlp.gate)
    module = VQMoEExperts.from_experts(experts, random_codes=True).half()
    case = make_moe_case(3, 2, 4, 64, 32, torch.float16, interpret)
    out = module(case.x, case.top_k_index, case.top_k_weights)
    case.gate_up_codes, case.gate_up_codebooks, case.gate_up_scales = (
        module.gate_up_codes, module.gate_up_codebooks, module.gate_up_scales)
    case.down_codes, case.down_codebooks, case.down_scales = module.down_codes, module.down_codebooks, module.down_scales
    _check(out, case)
    gate_up, down = module.dequantize()
    assert gate_up.shape == (4, 64, 64) and down.shape == (4, 64, 32)

    with pytest.raises(NotImplementedError, match="calibrated 2-bit MoE experts"):
        patch_vq(_tiny_qwen3_moe(), torch.randint(0, 256, (1, 8)), experts=True)
    calibrated = _tiny_qwen3_moe()          # the default under calibration: the Linears, experts dense
    assert patch_vq(calibrated, torch.randint(0, 256, (1, 16)), iters=1, init_iters=1, progress=False) == 4
    assert not any(isinstance(m, VQMoEExperts) for m in calibrated.modules())
    with pytest.raises(ValueError, match="experts: expected True or False"):
        patch_vq(_tiny_qwen3_moe(), random_codes=True, experts="yes")
    dense = _tiny_qwen3_moe()
    patch_vq(dense, random_codes=True, experts=False)
    assert not any(isinstance(m, VQMoEExperts) for m in dense.modules())
    replaced = patch_vq(model, random_codes=True)
    assert isinstance(model.model.layers[0].mlp.experts, VQMoEExperts)
    assert replaced == 4 + 1     # q/k/v/o projections and one experts module (the MoE block has no dense MLP)
    assert type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 256, (1, 5))).logits
    assert logits.shape == (1, 5, 256) and torch.isfinite(logits).all()


# ------------------------------------------------------------------ Gluon compile checks (CPU)
def _compile(kernel, dtype, pairs, n, k, grouped=False, **override):
    from tilefuse.ops.vq import configs
    from tilefuse.testing.gluon import compile_gluon_isolated

    cfg = configs.moe_config(pairs, n, k, True, 132, **override)
    element = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    if kernel == "gate_up":
        pointers = dict(x_ptr=element, idx_ptr="*i64", codes_ptr="*i16", cb_ptr=element, scales_ptr=element,
                        out_ptr=element, sched_ptr="*i32", tok_ptr="*i32", pairs_ptr="*i32")
        ints = dict(NUM_EXPERTS=128, TOPK=8, I=n, NUM_GROUPS=k // 8, GROUPS_PER_SLICE=cfg["groups_per_slice"],
                    stride_xm=k, stride_ce=2 * n * (k // 8), stride_cn=k // 8, stride_om=n, NUM_TILES=pairs)
    else:
        pointers = dict(h_ptr=element, idx_ptr="*i64", w_ptr="*fp32", codes_ptr="*i16", cb_ptr=element,
                        scales_ptr=element, out_ptr="*fp32", sched_ptr="*i32", pairs_ptr="*i32")
        ints = dict(NUM_EXPERTS=128, TOPK=8, H=n, NUM_GROUPS=k // 8, GROUPS_PER_SLICE=cfg["groups_per_slice"],
                    stride_hm=k, stride_ce=n * (k // 8), stride_cn=k // 8, stride_om=n,
                    NUM_TILES=pairs)   # op._moe_plan's values
    signature = dict(pointers)
    signature.update({name: "i32" for name in ints})
    constexprs = dict(TOKENS=cfg["tokens"], KREP=cfg["krep"], ROW_TILES=cfg["row_tiles"], SLICES=cfg["slices"],
                      COPIES=cfg["copies"], EVEN=cfg["even"], GROUPED=grouped)
    signature.update({name: "constexpr" for name in constexprs})
    aligned = list(pointers) + [name for name, value in ints.items() if value % 16 == 0]
    return cfg, compile_gluon_isolated(f"tilefuse.ops.vq.kernels_moe:vq_moe_{kernel}_kernel", signature, constexprs,
                                       num_warps=cfg["num_warps"], aligned=aligned)


@pytest.mark.parametrize("kernel,dtype,pairs,n,k,grouped,override", [
    ("gate_up", torch.bfloat16, 8, 768, 2048, False, {}), ("down", torch.bfloat16, 8, 2048, 768, False, {}),
    ("gate_up", torch.bfloat16, 256, 768, 2048, True, {}), ("down", torch.bfloat16, 256, 2048, 768, True, {}),
    ("gate_up", torch.float16, 1024, 1408, 2048, True, dict(copies=8, row_tiles=2, slices=4, krep=2)),
    ("down", torch.float16, 200, 2048, 1408, True, dict(tokens=16, slices=4)),
    ("down", torch.float16, 6, 2048, 1408, False, dict(copies=2, slices=4)),
    ("gate_up", torch.float16, 3, 40, 136, False, {})])
def test_moe_kernels_compile(kernel, dtype, pairs, n, k, grouped, override):
    """No spills; the codebook copies (one pair per expert) are the first shared store, at
    ``global_smem`` + 0; MMAs; no atomics (nothing split over programs)."""
    from tilefuse.testing.gluon import first_shared_store_offset

    cfg, result = _compile(kernel, dtype, pairs, n, k, grouped, **override)
    assert result.spilled == 0, result.ptxas
    assert 0 < result.registers <= 255 and 512 * cfg["copies"] * 16 <= result.shared <= 232448
    assert "mma.sync" in result.ptx and "global_smem" in result.ptx
    assert first_shared_store_offset(result.ptx) == 0
    assert "red.global" not in result.ptx and "atom.global" not in result.ptx


@pytest.mark.parametrize("pairs,experts,index", [(16384 * 8, 512, "*i64"), (160, 16, "*i32"), (1, 1, "*i64")])
def test_moe_schedule_kernel_compiles(pairs, experts, index):
    """The schedule kernel at its largest bins and block, and at small ones, for sm_90: no spills,
    no global atomics (the histogram's integer counts are exact in any order)."""
    from tilefuse.ops.vq import configs
    from tilefuse.testing.gluon import compile_gluon_isolated

    meta = configs.moe_schedule_meta(pairs, experts)
    constexprs = {name: value for name, value in meta.items() if name != "num_warps"}
    signature = dict(idx_ptr=index, sched_ptr="*i32", tok_ptr="*i32", pairs_ptr="*i32")
    signature.update({name: "i32" for name in ("P", "NUM_EXPERTS", "TOPK", "TOKENS", "NUM_TILES")})
    signature.update({name: "constexpr" for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.vq.kernels_moe:vq_moe_schedule_kernel", signature, constexprs,
                                    num_warps=meta["num_warps"], aligned=list(signature)[:4])
    assert result.spilled == 0, result.ptxas
    assert 0 < result.registers <= 255
    assert "red.global" not in result.ptx and "atom.global" not in result.ptx


def test_moe_dequant_kernel_compiles():
    """The experts' dequantize kernel (the dequantize kernel's tile over a third grid axis) for
    sm_90 with the dequantize path's launch: no spills, no atomics, 16-byte weight stores."""
    from tilefuse.testing.gluon import compile_gluon_isolated

    launch = vq_op.DEQUANT_LAUNCH
    signature = dict(codes_ptr="*u8", cb_ptr="*bf16", scales_ptr="*bf16", w_ptr="*bf16")
    signature.update({name: "i32" for name in ("N", "NUM_GROUPS", "stride_cn", "stride_wn", "stride_ce", "stride_we")})
    constexprs = dict(BLOCK_N=launch["BLOCK_N"], BLOCK_G=launch["BLOCK_G"])
    signature.update({name: "constexpr" for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.vq.kernels_moe:vq_moe_dequant_kernel", signature, constexprs,
                                    num_warps=launch["num_warps"],
                                    aligned=list(signature)[:4] + ["stride_cn", "stride_wn", "stride_ce", "stride_we"])
    assert result.spilled == 0, result.ptxas
    assert "red.global" not in result.ptx and "atom.global" not in result.ptx
    assert "st.global.v4" in result.ptx


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e,h,i,k", MOE_SHAPES)
def test_gpu_moe_dequant_path(e, h, i, k, dtype):
    """The dequantize path at both expert shapes and 256 tokens (out-of-range ids among them),
    within the dequantize tolerance; with bf16 (the dtype the dispatch takes it for), a CUDA graph
    of it replayed after new routing gives the new routing's output (PyTorch's fp16 grouped GEMM
    reads its offsets on the host: it runs eagerly only)."""
    from tilefuse.testing.vq import check_moe

    gen = torch.Generator().manual_seed(11)
    case = make_moe_case(256, k, e, h, i, dtype, "cuda")
    case.top_k_index[5, 0] = e
    check_moe(_run_dequant(case), case, "dequant")
    if dtype != torch.bfloat16:
        return
    call = vq_op._moe_plan(256, k, e, h, i, case.x.device, dequant=True)
    out = torch.empty_like(case.x)
    vq_op.launch_moe_dequant(call, *case.args(), out)          # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vq_op.launch_moe_dequant(call, *case.args(), out)
    case.top_k_index.copy_(torch.rand(256, e, generator=gen).argsort(dim=1)[:, :k])
    graph.replay()
    torch.cuda.synchronize()
    check_moe(out, case, "dequant")


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,i,k", MOE_SHAPES)
@pytest.mark.parametrize("t", [1, 3, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_moe_shapes(e, h, i, k, t, dtype):
    case = make_moe_case(t, k, e, h, i, dtype, "cuda", index_dtype=torch.int32 if t == 3 else torch.int64)
    _check(_run(case, impl="gluon", grouped=False), case)
    _check(_run(case, impl="gluon", grouped=True), case)
    _check(tilefuse.vq_moe(*case.args()), case)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up,down", [(dict(copies=2), dict(copies=8)), (dict(row_tiles=2, slices=4, krep=2), dict(row_tiles=2, slices=2)),
                                          (dict(slices=2, krep=2), dict(slices=4, copies=1)),
                                          (dict(copies=8, slices=8), dict(slices=2))])
@pytest.mark.parametrize("t,k,e,h,i", [(5, 8, 16, 2048, 768), (3, 3, 4, 136, 40), (9, 2, 3, 1032, 24),
                                       (40, 4, 2, 264, 32)])
@pytest.mark.parametrize("grouped", [False, True])
def test_gpu_moe_settings_and_edges(gate_up, down, t, k, e, h, i, grouped):
    """Settings, odd H/8 and I/8 (masked tails), repeated experts, sentinel ids, int8 codes, several
    tiles per expert (80 pairs over 2 experts)."""
    for dtype in (torch.float16, torch.bfloat16):
        case = make_moe_case(t, k, e, h, i, dtype, "cuda", codes_dtype=torch.int8, distinct=k <= e)
        case.top_k_index[0, 0] = e
        case.top_k_index[-1, -1] = -1
        _check(_run(case, impl="gluon", gate_up=gate_up, down=down, grouped=grouped), case)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 100])
def test_gpu_moe_bit_identical_repeats_and_graph_replays(t):
    """No atomics: every launch, eager or replayed, gives the same bits (routing, and at 800 pairs
    the grouped schedule, computed on the device)."""
    case = make_moe_case(t, 8, 128, 2048, 768, torch.bfloat16, "cuda")
    first = repeats_and_replays_identical(lambda: tilefuse.vq_moe(*case.args()))
    _check(first, case)


@pytest.mark.gpu
def test_gpu_moe_module_matches_dense_experts():
    """VQMoEExperts against transformers' own experts loop on the dequantized weights (bf16 GEMMs:
    within bf16's rounding of its intermediates, relative Frobenius error below 2^-6)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from tilefuse.nn import VQMoEExperts

    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    torch.manual_seed(0)
    with torch.device("cuda"):
        stock = Qwen3MoeExperts(config).to(torch.bfloat16)
        torch.nn.init.normal_(stock.gate_up_proj, std=0.02)
        torch.nn.init.normal_(stock.down_proj, std=0.02)
    module = VQMoEExperts.from_experts(stock, random_codes=True)
    gate_up, down = module.dequantize()
    with torch.no_grad():
        stock.gate_up_proj.copy_(gate_up)
        stock.down_proj.copy_(down)
        case = make_moe_case(7, 8, 128, 2048, 768, torch.bfloat16, "cuda")
        want = stock(case.x, case.top_k_index, case.top_k_weights).float()
        got = module(case.x, case.top_k_index, case.top_k_weights).float()
    assert ((got - want).norm() / want.norm()).item() < 2.0 ** -6


@pytest.mark.gpu
def test_gpu_moe_schedule_kernel_is_bit_identical_to_the_torch_schedule():
    """The schedule kernel against ``moe_schedule`` on the GPU up to 16384 tokens x top-8 (prefill)
    and 512 experts: random ids with out-of-range ones, skewed routing, E = 1, int32 and int64."""
    gen = torch.Generator().manual_seed(2)
    for name, index, e, tokens, block in _schedule_cases(gen, big=True):
        _check_schedule(index.cuda(), e, tokens, block, name)


@pytest.mark.gpu
def test_gpu_moe_schedule_graph_replay_takes_new_routing():
    """A CUDA graph of the schedule kernel (and of the grouped op) replayed after new routing is
    copied into its input gives the new routing's schedule (and output)."""
    gen = torch.Generator().manual_seed(3)
    t, k, e, tokens = 300, 8, 128, 8
    index = torch.randint(0, e, (t, k), generator=gen).cuda()
    tiles, _ = _schedule_kernel(index, e, tokens)                 # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, static = _schedule_kernel(index, e, tokens)
    for routing in (torch.randint(-1, e + 1, (t, k), generator=gen), torch.full((t, k), 7)):
        index.copy_(routing)
        graph.replay()
        torch.cuda.synchronize()
        for what, a, b in zip(("schedule", "tokens", "pairs"), static, vq_op.moe_schedule(index, e, tokens, tiles)):
            assert torch.equal(a, b), what

    case = make_moe_case(40, 8, 16, 264, 32, torch.bfloat16, "cuda")        # 320 pairs: grouped
    assert vq_op._plan_moe(case.x, *case.args()[1:]).grouped
    tilefuse.vq_moe(*case.args())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilefuse.vq_moe(*case.args())
    case.top_k_index.copy_(torch.randint(0, 16, case.top_k_index.shape, generator=gen))
    case.top_k_index[3, 1] = -1
    graph.replay()
    torch.cuda.synchronize()
    _check(out, case)


def test_explain_says_per_pair_or_grouped_and_why(interpret):
    """``tilefuse.explain(tilefuse.vq_moe, ...)``: the form the op's own plan runs, per pair below
    ``group_pairs`` pairs and grouped from there, with both forms described; the reference for
    fp32 inputs, nothing routed for no tokens; bad input raises as the op does."""
    from tilefuse.ops.vq import configs

    threshold = configs.MOE["group_pairs"]
    small = make_moe_case(3, 2, 4, 64, 32, torch.float16, interpret)
    choice = tilefuse.explain(tilefuse.vq_moe, *small.args())
    assert choice.variant == "per_pair"
    assert [c.variant for c in choice.candidates] == ["per_pair", "grouped", "dequant"]
    assert f"group_pairs = {threshold}" in choice.source and "per_pair" in str(choice)
    big = make_moe_case(threshold // 2, 2, 4, 64, 32, torch.float16, interpret)
    assert tilefuse.explain("vq_moe", *big.args()).variant == "grouped"
    assert tilefuse.explain(tilefuse.vq_moe, *make_moe_case(3, 2, 4, 64, 32, torch.float32,
                                                             interpret).args()).variant == "reference"
    empty = make_moe_case(0, 2, 4, 64, 32, torch.float16, interpret)
    assert tilefuse.explain(tilefuse.vq_moe, *empty.args()).variant == "empty"
    with pytest.raises(ValueError, match="top_k_weights"):
        tilefuse.explain(tilefuse.vq_moe, small.x, small.top_k_index, small.top_k_weights[:, :1], *small.args()[3:])
