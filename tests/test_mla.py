"""MLA decode over a paged cache: the Triton kernels in the CPU interpreter (fp16/fp32, small
paged cases) against the fp64 reference, the metadata schedule, input validation, and the GPU tests.

Tolerances (elementwise, |out - ref| <= atol + rtol |ref|, ref in fp64):
* fp32: the dots run in IEEE fp32, so only accumulation-order rounding remains: 1e-5.
* fp16: P is rounded to fp16 before the P V dot and out is rounded to fp16 (2^-11 relative):
  out atol = rtol = 2e-3; lse comes from fp32 scores of exact fp16 products: atol 1e-4.
A kernel that reads a NaN slot, drops a split or mis-weights the combine is off by O(0.1) or NaN.
"""

import pytest
import torch

import tilefuse
from tilefuse.ops.mla import configs, op
from tilefuse.ops.mla.reference import dequantize_kv_reference, mla_decode_reference, mla_sparse_decode_reference
from tilefuse.testing.compare import assert_close, captured, cos_diff
from tilefuse.testing.mla import make_case

# (atol, rtol of out; atol of lse). fp32: a logit's rounding error is about eps32 * scale * sum |q_i k_i|
# (576 products of unit-variance values: ~8e-6 at scale 0.3), and an output moves by that times |v|
# (up to ~3), so 4e-5 absolute; the observed worst case is 1.2e-5 (Triton 3.9's interpreter).
TOL = {torch.float32: (4e-5, 1e-5, 1e-5), torch.float16: (2e-3, 2e-3, 1e-4)}


@pytest.fixture(autouse=True)
def small_split_cost(request, monkeypatch):
    """The interpreter's cases are a few pages long, shorter than the schedules' split costs, so
    neither schedule would split them: their kernels run with split costs of one page (the
    attention is the same for any schedule). The schedules' own tests keep the shipped costs."""
    if "interpret" in request.fixturenames and not request.node.get_closest_marker("shipped_split_cost"):
        monkeypatch.setattr(configs, "SPLIT_COST_PAGES", 1)
        monkeypatch.setattr(configs, "PART_SPLIT_COST_PAGES", 1)


def _force_schedule(monkeypatch, which: str) -> None:
    """Make the metadata pick one schedule whatever the batch: "parts" or "slots"."""
    monkeypatch.setattr(configs, "PART_MIN_PAGES", 0)
    monkeypatch.setattr(configs, "PART_GAIN", 100.0 if which == "parts" else 0.0)


@pytest.fixture
def mla_configs(monkeypatch):
    """Edit the MLA launch settings for one test (the cached per-shape choice is cleared around it)."""
    configs.launch_config.cache_clear()
    yield configs
    monkeypatch.undo()
    configs.launch_config.cache_clear()


def _run(inp, causal, parts=None, variant=None):
    s_q, h_q = inp.q.shape[1], inp.q.shape[2]
    with tilefuse.force(variant=variant):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1, num_sm_parts=parts)
        return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=causal)


def _check(out, lse, inp, causal):
    atol, rtol, lse_atol = TOL[inp.q.dtype]
    ro, rl = mla_decode_reference(*inp.args(), 512, causal=causal, compute_dtype=torch.float64)
    assert out.dtype == inp.q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN/inf in out (a NaN slot leaked, or a row was not written)"
    assert_close(out, ro, atol=atol, rtol=rtol)
    assert_close(lse, rl, atol=lse_atol, rtol=1e-5, name="lse")   # +inf rows must match exactly


# (lengths, s_q, h_q, causal, variant, sm parts): zero lengths, 1-token and page-edge lengths,
# splits and the fused combine (few parts), causal multi-token, both orientations, 128 heads.
CASES = [
    ([0, 1, 63, 64, 65, 200], 1, 16, False, None, 4),
    ([130, 70], 2, 16, True, None, 8),
    ([130, 70], 2, 16, True, "standard", 8),
    ([257], 1, 16, True, "transposed", 1),          # one slot: written directly, no combine
    ([150, 3, 0], 1, 128, True, None, 10),
    ([100, 190], 2, 128, False, None, 6),
    ([150, 40], 2, 32, True, "transposed", 8),      # 64 rows forced transposed
    ([99], 4, 1, True, None, 8),                    # s_q = 4 (speculative decoding), 1 head
    ([150, 3, 0], 1, 128, True, "wgmma", 10),       # the Gluon kernel pinned: the tl kernel runs here
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("lens,s_q,h_q,causal,variant,parts", CASES)
def test_mla_interpret(interpret, dtype, lens, s_q, h_q, causal, variant, parts):
    inp = make_case(lens, s_q, h_q, dtype, interpret)
    out, lse = _run(inp, causal, parts, variant)
    _check(out, lse, inp, causal)


# Page sizes other than FlashMLA's 64: lengths that end mid-page and cross pages, a split that
# starts mid-page (few parts), both orientations (and both tile widths: BLOCK_N 32 / 64 against
# pages of 16 and 32, where a tile spans pages), NaN in every slot not written.
@pytest.mark.parametrize("page", [16, 32, 128, 256])
@pytest.mark.parametrize("lens,s_q,h_q,causal,variant,parts", [
    ([0, 1, 15, 17, 33, 200], 1, 16, True, None, 4),
    ([300, 70], 2, 8, True, "transposed", 8),
    ([130, 257], 1, 64, False, "standard", 3),
])
def test_mla_page_sizes_interpret(interpret, page, lens, s_q, h_q, causal, variant, parts):
    inp = make_case(lens, s_q, h_q, torch.float16, interpret, page_size=page)
    assert inp.k_cache.shape[1] == page
    out, lse = _run(inp, causal, parts, variant)
    _check(out, lse, inp, causal)


def test_mla_page_size_checks(interpret):
    inp = make_case([40], 1, 16, torch.float16, interpret, page_size=32)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1)
    bad = inp.k_cache.new_zeros(4, 48, 1, 576)
    with pytest.raises(ValueError, match=r"k_cache: expected \[num_blocks, page, 1, 576\] with page in"):
        tilefuse.flash_mla_with_kvcache(inp.q, bad, inp.block_table, inp.cache_seqlens, 512, meta, splits)
    # lengths beyond the block table's pages of this size are refused when contents are checked
    too_long = torch.tensor([inp.block_table.shape[1] * 32 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="pages of 32"):
        tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, too_long, 512, meta, splits,
                                        check_contents=True)


@pytest.mark.parametrize("variant,config", [
    ("transposed", dict(BLOCK_N=32, num_warps=4, num_stages=1, slot_programs=2, fused_combine=False)),
    ("transposed", dict(BLOCK_N=64, num_warps=4, num_stages=2, slot_programs=3, fused_combine=True)),
    ("standard", dict(BLOCK_H=0, BLOCK_N=64, num_warps=4, num_stages=2, slot_programs=1, fused_combine=False)),
    ("standard", dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=2, slot_programs=2, fused_combine=True)),
    ("standard", dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=3, slot_programs=2, fused_combine=False)),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mla_other_configs(interpret, monkeypatch, mla_configs, variant, config, dtype):
    """The sweep's alternatives: second-launch combine, unpadded standard tiles, half-page steps,
    several programs per slot (empty parts included: one-page slots cut in 2 or 3)."""
    monkeypatch.setitem(configs.CONFIGS, "standard_small" if variant == "standard" else variant, config)
    inp = make_case([0, 1, 130, 200, 64], 2, 8, dtype, interpret)
    out, lse = _run(inp, True, 9, variant)
    _check(out, lse, inp, True)


def test_mla_regime_dispatch(interpret, monkeypatch, mla_configs):
    """<= 16 rows: the block table's width picks the orientation and the regime's config."""
    assert op.choose_variant(16, configs.LONG_CONTEXT_PAGES - 1) == configs.SMALL_ROWS_VARIANT["short"]
    assert op.choose_variant(16, configs.LONG_CONTEXT_PAGES) == configs.SMALL_ROWS_VARIANT["long"]
    assert op.choose_variant(32, 10 ** 6) == "transposed" and op.choose_variant(64, 1) == "standard"
    with tilefuse.force(variant="transposed"):
        assert op.choose_variant(16, 10 ** 6) == "transposed"
    with tilefuse.force(variant="small_m"):      # another family's variant: MLA dispatches as usual
        assert op.choose_variant(64, 1) == "standard"
    # A small threshold runs the long regime here, with a config only that regime uses.
    monkeypatch.setattr(configs, "LONG_CONTEXT_PAGES", 3)
    monkeypatch.setitem(configs.SMALL_ROWS_VARIANT, "long", "standard")
    monkeypatch.setitem(configs.CONFIGS, "standard_small:long",
                        dict(BLOCK_H=0, BLOCK_N=32, num_warps=4, num_stages=2, slot_programs=2, fused_combine=False))
    cfg, fused, per_slot, _ = configs.launch_config("standard", 16, 3)
    assert fused is False and per_slot == 2 and cfg["num_stages"] == 2
    inp = make_case([0, 150, 64, 33], 1, 16, torch.float16, interpret)
    out, lse = _run(inp, True, 5)
    _check(out, lse, inp, True)


@pytest.mark.parametrize("name,small_rows", [("NVIDIA H200", "wgmma"), ("NVIDIA H100 80GB HBM3", "wgmma"),
                                             ("NVIDIA H20", "transposed")])
def test_mla_dispatch_pads_rows_only_where_the_chip_stays_memory_bound(name, small_rows):
    """Below 64 rows the Gluon kernel pads to 64: on an H20 (about 40 FLOP/B) that is compute-bound, so
    the unpadded transposed kernel takes those shapes; from 64 rows the Gluon kernel everywhere."""
    chip = configs.ridge(name)
    assert [configs.default_variant(rows, 64, True, chip) for rows in (16, 32)] == [small_rows] * 2
    assert configs.default_variant(64, 64, True, chip) == configs.default_variant(512, 64, True, chip) == "wgmma"
    assert configs.default_variant(64, 64, False, chip) == "standard"   # no Gluon: the tl kernels


def test_mla_metadata_reused_across_layers(interpret):
    """One get_mla_metadata per step serves every layer: the combine's counters reset themselves."""
    inp = make_case([300, 5, 0, 170], 2, 16, torch.float16, interpret)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 32, 1, num_sm_parts=12)
    assert int(splits[-1]) > len(splits) - 1, "the case must split some request"
    for _ in range(3):
        inp.q.normal_()
        out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
        _check(out, lse, inp, True)


def test_mla_softmax_scale(interpret):
    inp = make_case([90, 33], 1, 16, torch.float32, interpret)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=4)
    out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, softmax_scale=0.3)
    ro, rl = mla_decode_reference(*inp.args(), 512, 0.3, compute_dtype=torch.float64)
    atol, rtol, lse_atol = TOL[torch.float32]
    assert_close(out, ro, atol=atol, rtol=rtol)
    assert_close(lse, rl, atol=lse_atol, rtol=1e-5, name="lse")


def _schedule_of(lens, parts):
    """Kernel and PyTorch mirror agree; every request's splits cover its pages once, in order, and
    the programs' runs (column 7) cover the used slots once (``op.check_schedule``). Returns
    (meta, num_splits, which schedule ran)."""
    seqlens = torch.tensor(lens, dtype=torch.int32)
    meta, splits = tilefuse.get_mla_metadata(seqlens, 16, 1, num_sm_parts=parts)
    meta_ref, splits_ref = op._metadata_torch(seqlens, parts)
    assert torch.equal(meta, meta_ref) and torch.equal(splits, splits_ref)
    assert meta.shape == (op.metadata_slots(parts, len(lens)), 8) and splits.shape == (len(lens) + 1,)
    op.check_schedule(seqlens, meta, splits)
    used = int(splits[-1])
    one_each = torch.arange(meta.shape[0]).clamp_max(used).to(meta.dtype)
    return meta, splits, "slots" if torch.equal(meta[:, 7], one_each) else "parts"


def _check_parts(lens, parts):
    """The parts schedule: each program's run is ``configs.schedule_splits``'s, and every part's
    work (pages + split costs) is within the balanced share plus two split costs (one for a split
    that starts the part inside a request, one for the cuts' rounding to whole pages)."""
    meta, splits, _ = _schedule_of(lens, parts)       # (one split per part reads as "slots" too)
    pages = [(n + 63) // 64 for n in lens]
    runs = configs.schedule_splits(pages, parts)
    starts = meta[:, 7].tolist()
    for p in range(parts):
        got = [(r, begin, end) for r, _, begin, end in meta[starts[p]:starts[p + 1], :4].tolist()]
        assert got == runs[p], p
    assert int(splits[-1]) <= parts - 1 + len(lens)
    cost = configs.PART_SPLIT_COST_PAGES
    share = (sum(pages) + cost * len(lens)) / parts
    assert max(configs.part_loads(pages, parts)) <= share + 2 * cost + 1


def _check_slots(lens, parts):
    """The slots schedule: even splits of one chunk, one per program; the chunk's expected busiest
    part no worse than the best one-wave schedule's and within 10 % of the best chunk of all
    (brute force)."""
    meta, splits, which = _schedule_of(lens, parts)
    assert which == "slots"
    pages = [(n + 63) // 64 for n in lens]
    counts = (splits[1:] - splits[:-1]).tolist()
    chunk = max(-(-p // n) for p, n in zip(pages, counts))
    rows = op.metadata_slots(parts, len(lens))
    assert min(counts) >= 1 and sum(counts) < rows

    def cost_at(c):
        n = sum(max(-(-p // c), 1) for p in pages)
        return configs.schedule_cost(sum(pages), n, c, parts) if n < rows else float("inf")

    cost = configs.schedule_cost(sum(pages), sum(counts), chunk, parts)
    one_wave = next((c for c in range(1, max(pages + [1]) + 1) if sum(max(-(-p // c), 1) for p in pages) <= parts),
                    max(pages + [1]))
    assert cost <= cost_at(one_wave)
    assert cost <= 1.1 * min(cost_at(c) for c in range(1, max(pages + [1]) + 1))


SCHEDULE_BATCHES = [([0, 1, 63, 64, 65, 200], 4), ([5000, 64, 0], 16), ([0, 0], 3), ([64 * 7] * 8, 132),
                    ([1] * 40, 8), ([1024] * 64, 132), ([0], 132),
                    ([64 * 900, 64 * 30, 64 * 500, 64 * 77, 1, 64 * 200] * 4, 40)]


def _uneven_batches():
    gen = torch.Generator().manual_seed(0)
    zipf = (20000 / torch.arange(1, 97, dtype=torch.float64) ** 1.1).long().tolist()
    return [
        ([131072] + [int(v) for v in torch.randint(1, 2000, (255,), generator=gen)], 132),  # one long among short
        ([70000] + [int(v) for v in torch.randint(1, 20000, (95,), generator=gen)], 66),    # 96 requests, 2 head tiles
        ([70000] + [int(v) for v in torch.randint(1, 20000, (95,), generator=gen)], 132),
        (zipf, 132),                                                                        # Zipf lengths
        ([0, 0, 90000, 0, 5, 0] * 3, 132),                                                  # zero lengths
        ([1, 300, 70000], 132),
    ]


@pytest.mark.shipped_split_cost
@pytest.mark.parametrize("which", ["slots", "parts"])
@pytest.mark.parametrize("lens,parts", SCHEDULE_BATCHES + _uneven_batches())
def test_mla_metadata_schedules(interpret, monkeypatch, which, lens, parts):
    """Each schedule forced on even, uneven (one long request among short ones, Zipf, zero
    lengths) and tiny batches: its invariants (``_check_slots``, ``_check_parts``)."""
    _force_schedule(monkeypatch, which)
    (_check_slots if which == "slots" else _check_parts)(lens, parts)


@pytest.mark.shipped_split_cost
@pytest.mark.parametrize("lens,parts,expect", [
    ([131072] + [1000] * 255, 132, "parts"),          # one long request among short ones
    ([70000] + [10000] * 95, 66, "parts"),            # a long one among 96 mid-length ones, 2 head tiles
    ([4096] * 16, 132, "slots"),                      # even batches
    ([1024] * 128, 132, "slots"),
    ([65536] * 64, 66, "slots"),
    ((20000 / torch.arange(1, 129, dtype=torch.float64) ** 1.1).long().tolist(), 132, "slots"),   # short Zipf
])
def test_mla_metadata_picks_the_schedule_by_its_cost_model(interpret, lens, parts, expect):
    """The shipped pick (``configs.PART_GAIN``, ``PART_MIN_PAGES``): parts where they balance long
    uneven batches, slots on even or short ones; the estimates it compares agree with the kernel's
    pick."""
    _, _, which = _schedule_of(lens, parts)
    assert which == expect
    pages = [(n + 63) // 64 for n in lens]
    seqlens = torch.tensor(lens, dtype=torch.int32)
    counts = (op._metadata_torch(seqlens, parts)[1].diff()).tolist() if which == "slots" else None
    if counts is not None:      # the slots' estimate did not clear the bar
        chunk = max(-(-p // n) for p, n in zip(pages, counts))
        slots_cost = configs.schedule_cost(sum(pages), sum(counts), chunk, parts)
        assert slots_cost < configs.PART_MIN_PAGES or configs.parts_cost(pages, parts) > configs.PART_GAIN * slots_cost


@pytest.mark.shipped_split_cost
def test_mla_metadata_property_random_mixes(interpret, monkeypatch):
    """Property test over random batches, both schedules and the pick: every split of every
    request covers its pages once (``op.check_schedule``), the kernel equals its PyTorch mirror,
    the parts stay balanced."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(12):
        b = int(torch.randint(1, 300, (1,), generator=gen))
        kind = trial % 3
        if kind == 0:
            lens = torch.randint(0, 20000, (b,), generator=gen)
        elif kind == 1:      # Zipf-like: a few long, many short
            lens = (60000 / torch.arange(1, b + 1, dtype=torch.float64) ** 1.2).long()
            lens = lens[torch.randperm(b, generator=gen)]
        else:                # zeros and ones among long requests
            lens = torch.randint(0, 3, (b,), generator=gen) * torch.randint(0, 90000, (b,), generator=gen)
        parts = int(torch.randint(1, 140, (1,), generator=gen))
        _schedule_of(lens.tolist(), parts)
        with monkeypatch.context() as m:
            _force_schedule(m, "parts")
            _check_parts(lens.tolist(), parts)
        with monkeypatch.context() as m:
            _force_schedule(m, "slots")
            _schedule_of(lens.tolist(), parts)


@pytest.mark.parametrize("which", ["slots", "parts"])
@pytest.mark.parametrize("lens,s_q,h_q,causal,variant,parts", [CASES[0], CASES[2], CASES[4], CASES[7]])
def test_mla_interpret_each_schedule(interpret, monkeypatch, which, lens, s_q, h_q, causal, variant, parts):
    """The kernels' outputs under each schedule forced (the other tests run whichever the pick gives)."""
    _force_schedule(monkeypatch, which)
    inp = make_case(lens, s_q, h_q, torch.float16, interpret)
    out, lse = _run(inp, causal, parts, variant)
    _check(out, lse, inp, causal)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mla_stale_metadata_is_still_correct(interpret, backend):
    """Metadata planned for other lengths (same batch) only schedules: outputs follow cache_seqlens."""
    inp = make_case([300, 5, 0, 170], 2, 16, torch.float16, interpret)
    stale = torch.tensor([1, 600, 64, 0], dtype=torch.int32)
    with tilefuse.force(backend=backend):
        meta, splits = tilefuse.get_mla_metadata(stale, 32, 1, num_sm_parts=7)
        out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
    _check(out, lse, inp, True)


def _garbage_schedules(inp):
    b = inp.q.shape[0]
    meta, splits = op._metadata_torch(inp.cache_seqlens, 5)
    zeroed = (torch.zeros_like(meta), torch.zeros_like(splits))
    wild_meta = meta.clone()
    wild_meta[:, 0] = torch.tensor([10 ** 6, -7, b, 2 ** 31 - 1]).repeat(meta.shape[0])[: meta.shape[0]]
    wild_splits = torch.tensor([0, 10 ** 6, -5] + [3] * (b - 2), dtype=torch.int32)
    # int32 counts whose differences and products overflow: bounds must be checked before arithmetic
    overflow = torch.tensor([2 ** 31 - 1, -2 ** 31 + 5, 2 ** 31 - 1, -2 ** 31 + 3][: b + 1], dtype=torch.int32)
    return {"zeroed": zeroed, "wild_requests": (wild_meta, splits), "wild_splits": (meta, wild_splits),
            "overflowing_splits": (meta, overflow)}


@pytest.mark.parametrize("which", ["zeroed", "wild_requests", "wild_splits", "overflowing_splits"])
def test_mla_bad_schedules_stay_in_bounds_and_debug_raises(interpret, which):
    """No metadata / num_splits contents move a kernel access outside its tensors (the interpreter
    would fail on a wild pointer); check_contents names the bad argument."""
    inp = make_case([130, 70, 0], 1, 16, torch.float16, interpret)
    meta, splits = _garbage_schedules(inp)[which]
    out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
    assert out.shape == (3, 1, 16, 512)
    with pytest.raises(ValueError, match="tile_scheduler_metadata|num_splits"):
        tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True, check_contents=True)


@pytest.mark.parametrize("bad", [-1, 10 ** 6, 2 ** 31 - 1])
def test_mla_bad_block_table_stays_in_bounds_and_is_refused(interpret, bad):
    """A used page outside the cache: the kernels clamp (no fault); the spec and the debug check
    raise ValueError naming block_table. Entries past a request's length are never read."""
    inp = make_case([130, 70], 1, 16, torch.float16, interpret)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=4)
    table = inp.block_table.clone()
    table[0, 1] = bad
    args = (inp.q, inp.k_cache, table, inp.cache_seqlens, 512, meta, splits)
    out, _ = tilefuse.flash_mla_with_kvcache(*args, causal=True)
    assert out.shape == (2, 1, 16, 512)
    with pytest.raises(ValueError, match="block_table: expected pages in"):
        tilefuse.flash_mla_with_kvcache(*args, causal=True, check_contents=True)
    with tilefuse.force(backend="reference"), pytest.raises(ValueError, match="block_table: expected pages in"):
        tilefuse.flash_mla_with_kvcache(*args, causal=True)
    # padding (-1) after the used pages is fine on both backends
    padded = torch.cat((inp.block_table, torch.full((2, 3), -1, dtype=torch.int32)), dim=1)
    for backend in ("triton", "reference"):
        with tilefuse.force(backend=backend):
            out, lse = tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, padded, inp.cache_seqlens, 512,
                                                       meta, splits, causal=True, check_contents=True)
        _check(out, lse, inp, True)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mla_nan_propagates_and_masked_slots_never_leak(interpret, backend):
    """NaN in one query head gives NaN in that head only; NaN slots past the lengths never leak."""
    inp = make_case([90, 33], 1, 16, torch.float32, interpret)
    inp.q[1, 0, 5, 7] = float("nan")
    with tilefuse.force(backend=backend):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=4)
        out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
    nan_heads = torch.isnan(out).any(-1)
    expected = torch.zeros_like(nan_heads)
    expected[1, 0, 5] = True
    assert torch.equal(nan_heads, expected) and torch.isnan(lse[1, 5, 0])
    assert torch.isfinite(lse[~torch.isnan(lse)]).all()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mla_fp16_extremes_stay_a_convex_combination(interpret, backend):
    """q, k near fp16's top (60000): scores ~1e11; outputs are weighted means of V rows, never inf."""
    inp = make_case([70, 20], 1, 16, torch.float16, interpret, nan_tail=False)
    inp.q.fill_(60000.0)
    inp.k_cache.copy_(torch.where(torch.rand_like(inp.k_cache, dtype=torch.float32) < 0.5, 60000.0, 59000.0))
    with tilefuse.force(backend=backend):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=4)
        out, _ = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
    assert torch.isfinite(out).all()
    assert (out.float() >= 59000 - 64).all() and (out.float() <= 60000 + 64).all()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mla_empty_batch(interpret, backend):
    inp = make_case([5], 1, 16, torch.float16, interpret)
    q = inp.q[:0]
    with tilefuse.force(backend=backend):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens[:0], 16, 1, num_sm_parts=4)
        out, lse = tilefuse.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table[:0], inp.cache_seqlens[:0],
                                                   512, meta, splits, causal=True)
        choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, q, inp.k_cache, inp.block_table[:0],
                                  inp.cache_seqlens[:0], 512, meta, splits)
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1) and splits.tolist() == [0]
    assert choice.variant == "reference"        # nothing runs


def test_mla_gradient_request_is_refused(interpret):
    inp = make_case([40], 1, 16, torch.float32, interpret)
    q = inp.q.clone().requires_grad_()
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=2)
    out, _ = tilefuse.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta, splits)
    with pytest.raises(RuntimeError, match="flash_mla_with_kvcache: MLA decode attention has no backward"):
        out.sum().backward()


def test_mla_reference_backend_on_cpu():
    """Without the interpreter forced, CPU tensors run the PyTorch reference (same results)."""
    inp = make_case([70, 0], 2, 16, torch.float32, "cpu")
    with tilefuse.force(backend="reference"):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 32, 1)
        out, lse = tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)
    ro, rl = mla_decode_reference(*inp.args(), 512, causal=True, compute_dtype=torch.float64)
    assert_close(out, ro, atol=1e-5, rtol=1e-5)
    assert_close(lse, rl, atol=1e-5, rtol=1e-5, name="lse")


def test_mla_module(interpret):
    from tilefuse.nn import MLADecodeAttention

    inp = make_case([80, 130], 1, 16, torch.float16, interpret)
    attn = MLADecodeAttention(num_heads=16, softmax_scale=None, causal=True)
    attn.plan(inp.cache_seqlens)
    out, lse = attn(inp.q, inp.k_cache, inp.block_table)
    _check(out, lse, inp, True)
    with pytest.raises(ValueError, match="q: expected 8 heads"):
        MLADecodeAttention(num_heads=8)(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens)
    with pytest.raises(ValueError, match="num_heads"):
        MLADecodeAttention(num_heads=0)


# ------------------------------------------------------------------------------- errors


def _valid(dtype=torch.float16):
    inp = make_case([70, 10], 1, 16, dtype, "cpu")
    meta, splits = op._metadata_torch(inp.cache_seqlens, 4)
    return dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=meta, num_splits=splits)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][..., :512].contiguous()), "q: expected head dim 576"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :48]), "k_cache: expected .* with page in"),
    (lambda a: a.update(k_cache=a["k_cache"].to(torch.float32)), "k_cache: expected dtype"),
    (lambda a: a.update(block_table=a["block_table"].long()), "block_table: expected dtype int32"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), "cache_seqlens: expected dtype int32"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"] + 1000), "cache_seqlens: expected lengths in"),
    (lambda a: a.update(cache_seqlens=a["cache_seqlens"] - 100), "cache_seqlens: expected lengths in"),
    (lambda a: a.update(softmax_scale=float("inf")), "softmax_scale: expected a finite"),
    (lambda a: a.update(softmax_scale=float("nan")), "softmax_scale: expected a finite"),
    (lambda a: a.update(softmax_scale="abc"), "softmax_scale: expected a finite"),
    (lambda a: a.update(k_cache=a["k_cache"][:0]), "k_cache: expected at least one page"),
    (lambda a: a.update(head_dim_v=256), "head_dim_v"),
    (lambda a: a.update(block_table=a["block_table"].to("meta")), "block_table: expected a tensor on cpu"),
    (lambda a: a.update(num_splits=a["num_splits"][:-1]), "num_splits: expected shape"),
    (lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"][:, :4]), "tile_scheduler_metadata"),
    (lambda a: a.update(q=a["q"].to(torch.int8)), "q: expected dtype"),
])
def test_mla_bad_inputs(change, match):
    args = _valid()
    change(args)
    with pytest.raises(ValueError, match=match):
        tilefuse.flash_mla_with_kvcache(**args)


def test_mla_metadata_bad_inputs():
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens: expected dtype int32"):
        tilefuse.get_mla_metadata(lens.long(), 16, 1)
    with pytest.raises(ValueError, match="num_heads_k"):
        tilefuse.get_mla_metadata(lens, 16, 2)
    with pytest.raises(ValueError, match="num_q_tokens_per_head_k"):
        tilefuse.get_mla_metadata(lens, 0, 1)
    for parts in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="num_sm_parts: expected an integer >= 1"):
            tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=parts)
    with pytest.raises(ValueError, match="cache_seqlens: expected lengths in"):
        tilefuse.get_mla_metadata(lens - 10, 16, 1, check_contents=True)


def test_mla_compile_fullgraph():
    """Metadata + attention trace through the registered ops (CPU: aot_eager, reference backend)."""
    inp = make_case([70, 5], 1, 16, torch.float32, "cpu")

    def step(q, k_cache, block_table, lens):
        meta, splits = tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=4)
        return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True)

    with tilefuse.force(backend="reference"):
        eager = step(*inp.args())
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*inp.args())
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_mla_compile_fullgraph_with_content_checks():
    """``check_contents=True`` (and the metadata's) under ``torch.compile(fullgraph=True)``: the
    checks read tensors back, which tracing cannot do, so they are skipped there instead of
    raising a dynamo error on valid input; the eager call still checks."""
    inp = make_case([70, 5], 1, 16, torch.float32, "cpu")

    def step(q, k_cache, block_table, lens):
        meta, splits = tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=4, check_contents=True)
        return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                               check_contents=True)

    with tilefuse.force(backend="reference"):
        eager = step(*inp.args())
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*inp.args())
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        q, k_cache, block_table, lens = inp.args()
        with pytest.raises(ValueError, match="cache_seqlens"):
            step(q, k_cache, block_table, lens - 100)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_mla_meta_and_fake_tensors_get_shapes(check, fp8):
    """Meta tensors (and FakeTensorMode) give the outputs' shapes and dtypes, with or without
    content checks, on a 16-bit or an FP8 cache, instead of "Cannot copy out of meta tensor"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inp = make_case([70, 5], 2, 16, torch.float16, "cpu", nan_tail=not fp8)
    if fp8:
        inp.k_cache = tilefuse.mla_quantize_kv(inp.k_cache)

    def shapes(q, k_cache, block_table, lens):
        meta, splits = tilefuse.get_mla_metadata(lens, 32, 1, num_sm_parts=4, check_contents=check)
        assert meta.shape == (op.metadata_slots(4, 2), 8) and splits.shape == (3,)
        out, lse = tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                                   check_contents=check, is_fp8_kvcache=fp8)
        assert out.shape == (2, 2, 16, 512) and out.dtype == torch.float16
        assert lse.shape == (2, 16, 2) and lse.dtype == torch.float32
        return out

    assert shapes(*(t.to("meta") for t in inp.args())).device.type == "meta"
    with FakeTensorMode() as mode:
        shapes(*(mode.from_tensor(t) for t in inp.args()))


# ---------------------------------------------------------------- GPU (H200)
# Real shapes, bf16 and fp16, against the fp64 reference.
#
# Tolerances: out is compared by cos_diff (FlashMLA's bar, 1e-5) and elementwise with
# atol = rtol = 1e-2 (bf16 output rounding is 2^-8 = 4e-3 relative; out values are O(0.1)); lse
# with atol 1e-3 (fp32 online softmax over <= 64K keys with bf16-rounded P in the second dot only).


def _run_gpu(inp, s_q, h_q, causal, variant=None):
    with tilefuse.force(backend="triton", variant=variant):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=causal)


def _check_gpu(out, lse, inp, causal):
    ro, rl = mla_decode_reference(*inp.args(), 512, causal=causal, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert cos_diff(out, ro) < 1e-5
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isinf(lse), ~finite)          # empty rows: lse = +inf exactly
    assert cos_diff(lse[finite], rl[finite]) < 1e-5
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    assert_close(lse, rl, atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, "standard"])
@pytest.mark.parametrize("h_q,s_q,batch", [(8, 1, 4), (16, 2, 4), (24, 1, 4), (64, 1, 4), (128, 2, 4), (16, 1, 160)])
def test_gpu_sparse_kernel(h_q, s_q, batch, variant):
    """The sparse FP8 decode's kernels at DeepSeek-V3.2's size (topk 2048 over 8K-token contexts,
    topk_length below topk for one request, -1 padding, a sink), bf16 q: the fp64 reference. The
    default (the Gluon kernel on Hopper) and the tl kernel (pinned by ``variant="standard"``); batch
    160 fills the SMs more than twice over: the tl kernel's register-capped launch."""
    gen = torch.Generator().manual_seed(h_q)
    lens = ([8192, 3000, 8192, 100] * (batch // 4))[:batch]
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=64, nan_tail=False)
    packed = tilefuse.mla_quantize_kv(inp.k_cache)
    idx = torch.full((len(lens), s_q, 2048), -1, dtype=torch.int32)
    table = inp.block_table.cpu()
    for i, n in enumerate(lens):
        for t in range(s_q):
            tokens = torch.randperm(n, generator=gen)[:2048]
            idx[i, t, :len(tokens)] = table[i, tokens // 64].int() * 64 + (tokens % 64).int()
    idx, length = idx.cuda(), torch.tensor(([2048, 1500, 2048, 2048] * (batch // 4))[:batch], dtype=torch.int32,
                                           device="cuda")
    sink = torch.randn(h_q, device="cuda")
    with tilefuse.force(backend="triton", variant=variant):
        choice = tilefuse.explain("flash_mla_with_kvcache", inp.q, packed, None, None, 512, is_fp8_kvcache=True,
                                  indices=idx)
        out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, None, None, 512, None, None, is_fp8_kvcache=True,
                                                   indices=idx, topk_length=length, attn_sink=sink)
    if variant:
        assert choice.config["kernel"] == "tl"
    elif configs.sparse_gather_dense_pays(h_q, batch * s_q * 2048, eager=True):      # explain: an eager call
        assert choice.variant == "sparse_gather_dense"
    else:
        assert choice.config["kernel"] == "gluon"
    ro, rl = mla_sparse_decode_reference(inp.q, packed, idx, topk_length=length, attn_sink=sink,
                                         compute_dtype=torch.float64)
    assert torch.isfinite(out).all() and cos_diff(out, ro) < 1e-5
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    assert_close(lse, rl.float(), atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("h_q,s_q,variant", [(16, 1, "standard"), (128, 2, "standard"), (32, 1, "transposed")])
def test_gpu_fp8_dense_kernel(page, h_q, s_q, variant):
    """The dense FP8 decode on the tl kernels at real sizes (bf16 q), NaN bytes in unused slots:
    the fp64 reference on the dequantized cache."""
    lens = [1, page + 1, 4000, 0, 777]
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=page, nan_tail=False)
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache).cpu(), inp.block_table.cpu(), lens)
    packed = packed.cuda()
    with tilefuse.force(backend="triton", variant=variant):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
        out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta,
                                                   splits, causal=True, is_fp8_kvcache=True)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.bfloat16)
    _check_gpu(out, lse, inp, True)


@pytest.mark.parametrize("page", [16, 64, 128])
def test_fp8_descriptors_address_the_codes_rope_and_scales(page):
    """The Gluon FP8 kernel's TMA descriptors (``op._fp8_descriptors``) read, through the
    coordinates the kernel uses (codes at columns 0-511 in 128-wide boxes, RoPE at byte 528, the
    scales' fp32 box at the descriptor's base), exactly the values ``mla_dequantize_kv`` splits a
    row into, for a uint8 cache and FlashMLA's float8_e4m3fn view."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    latent = torch.randn(3 * page, 576).to(torch.bfloat16)
    packed = tilefuse.mla_quantize_kv(latent).view(3, page, 1, 656)
    for cache in (packed, packed.view(torch.float8_e4m3fn)):
        codes, scales = op._fp8_descriptors(cache)
        box = min(page, 64)
        assert codes.shape == [3 * page, 656] and codes.strides == [656, 1] and codes.block_shape == [box, 128]
        assert scales.shape == [3 * page, 4] and scales.strides == [164, 1] and scales.block_shape == [box, 4]
        rows = codes.base.reshape(-1, 656).view(torch.uint8)
        flat = scales.base.reshape(-1)
        words = torch.stack([flat[r * 164: r * 164 + 4] for r in range(3 * page)])
        raw = packed.reshape(-1, 656)
        assert torch.equal(rows, raw)
        assert torch.equal(words, raw[:, 512:528].contiguous().view(torch.float32))
        rope = rows[:, 528:656].contiguous().view(torch.bfloat16).float()
        assert torch.equal(rope, tilefuse.mla_dequantize_kv(packed, torch.float32).reshape(-1, 576)[:, 512:])


def _fp8_dense_as_dispatched(s_q, h_q, page, causal):
    """A dense FP8 decode at real sizes, bf16 q, as dispatched: lengths across pages, splits and
    programs (zero included), 0xFF (NaN) in every unused slot's bytes. Returns the case (its cache
    now the dequantized one, the reference's input), out, lse and the dispatch's choice."""
    lens = [1, page + 1, 4000, 0, 777, 20000, 63]
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=page, nan_tail=False)
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache).cpu(), inp.block_table.cpu(), lens)
    packed = packed.cuda()
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1)
    out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                               causal=causal, is_fp8_kvcache=True)
    choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, inp.q, packed, inp.block_table, inp.cache_seqlens,
                              is_fp8_kvcache=True)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.bfloat16)
    return inp, out, lse, choice


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, True), (16, 2, True), (8, 4, True), (1, 1, False), (5, 3, True),
                                            (32, 1, False), (16, 3, True), (128, 1, True)])
def test_gpu_fp8_dense_default(page, h_q, s_q, causal):
    """The dense FP8 decode as dispatched (on Hopper the Gluon FP8 kernel up to 32 query rows, the
    tl standard kernel above: 48 and 128 rows here; ``_fp8_dense_as_dispatched``'s lengths and NaN
    bytes, one request's splits spread over several parts): the fp64 reference on the
    dequantized cache."""
    inp, out, lse, choice = _fp8_dense_as_dispatched(s_q, h_q, page, causal)
    if op.wgmma_usable(inp.q.device):
        rows = s_q * h_q
        expected = ("wgmma_fp8_wide" if rows >= configs.FP8_WIDE_FROM_ROWS
                    else "wgmma_fp8" if rows <= configs.FP8_GLUON_MAX_ROWS else "standard")
        assert choice.variant == expected, choice
    _check_gpu(out, lse, inp, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,s_q", [(16, 3), (64, 1), (128, 1), (40, 2)])
def test_gpu_fp8_gluon_head_tiles(monkeypatch, h_q, s_q):
    """The Gluon FP8 kernel past one head tile (FP8_GLUON_MAX_ROWS raised to 128; the default keeps
    it to one): 48-128 query rows on tiles of 32, the last one partial (80 rows), each tile
    streaming every page of its part; ``_fp8_dense_as_dispatched``'s case; the fp64 reference."""
    if not op.wgmma_usable(torch.device("cuda")):
        pytest.skip("the Gluon FP8 kernel runs on Hopper")
    monkeypatch.setattr(configs, "FP8_GLUON_MAX_ROWS", 128)
    monkeypatch.setattr(configs, "FP8_WIDE_FROM_ROWS", 1 << 30)      # (its 64-row tiles out of the way)
    configs.launch_config.cache_clear()
    op._plans.clear()
    inp, out, lse, choice = _fp8_dense_as_dispatched(s_q, h_q, 64, True)
    op._plans.clear()
    configs.launch_config.cache_clear()
    assert choice.variant == "wgmma_fp8", choice
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,h_q,page", [(1, 64, 64), (2, 128, 16), (1, 40, 64), (2, 33, 32)])
@pytest.mark.parametrize("extra,sink", [(False, False), (True, True)])
@pytest.mark.parametrize("groups", [1, 3])
def test_gpu_sparse_gather_dense(s_q, h_q, page, extra, sink, groups, monkeypatch):
    """The sparse decode's gather + dense path (pinned; on Hopper with a bf16 q the cost model picks
    it for many heads and query tokens) on every index rule of ``_sparse_kernel_case`` (-1, outside the cache, repeats,
    topk_length with a 0, a second cache, a +-inf sink, NaN bytes in every unwritten slot), in one
    group of query tokens or several (the dense cache's byte cap lowered), in a CUDA graph replay
    too: the fp64 reference on the dequantized cache, to the 16-bit path's tolerances."""
    q, cache, idx, length, extra_cache, extra_idx, sinks = (
        _sparse_kernel_case(s_q, h_q, True, page, seed=3 * h_q + s_q, device="cuda"))
    q = q.to(torch.bfloat16)
    monkeypatch.setattr(configs, "SPARSE_GATHER_DENSE", True)      # the cost model prefers the other at this size
    if groups > 1:     # the 3 x s_q query tokens in groups of at most s_q (the last one shorter at s_q 2)
        width = idx.shape[-1] + (extra_idx.shape[-1] if extra else 0)
        monkeypatch.setattr(configs, "SPARSE_GATHER_MAX_BYTES", s_q * -(-width // 64) * 64 * 576 * 2)
    kwargs = dict(is_fp8_kvcache=True, indices=idx, topk_length=length)
    if extra:
        kwargs.update(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_idx)
    if sink:
        kwargs["attn_sink"] = sinks
    assert tilefuse.explain("flash_mla_with_kvcache", q, cache, None, None, 512, **kwargs).variant == \
        "sparse_gather_dense"
    out, lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, **kwargs)
    ro, rl = mla_sparse_decode_reference(q, cache, idx, topk_length=length, attn_sink=kwargs.get("attn_sink"),
                                         extra_k_cache=kwargs.get("extra_k_cache"),
                                         extra_indices=kwargs.get("extra_indices_in_kvcache"),
                                         compute_dtype=torch.float64)
    assert out.dtype == q.dtype and out.shape == ro.shape and torch.isfinite(out).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    finite = torch.isfinite(rl)
    # the dense kernel sums each row's total from P rounded to bf16 (2^-9 relative per term): with
    # the few tokens per query token here that shows in lse, up to ln(1 + 2^-9) = 1.95e-3
    assert_close(lse[finite], rl[finite].float(), atol=2e-3, rtol=1e-4, name="lse")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 128, 256])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (128, 1), (16, 4)])
@pytest.mark.parametrize("variant", [None, "standard"])
def test_gpu_page_sizes(page, h_q, s_q, variant):
    """Pages other than 64 on the GPU (the default kernel, Gluon on Hopper, and the tl kernel),
    bf16, lengths across pages and splits, NaN in the unwritten slots."""
    lens = [1, page - 1, page + 1, 5 * page + 3, 4000]
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=page)
    out, lse = _run_gpu(inp, s_q, h_q, True, variant)
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (16, 2), (16, 3), (16, 4), (32, 1), (64, 1), (128, 2), (1, 4)])
@pytest.mark.parametrize("variant", ["transposed", "standard", "wgmma"])   # the default is one of them
def test_mla_gpu_equal(dtype, h_q, s_q, variant):
    if variant == "transposed" and h_q * s_q >= 64:
        pytest.skip("transposed applies below 64 query rows")
    inp = make_case([4096 + 17] * 8, s_q, h_q, dtype, "cuda")
    out, lse = _run_gpu(inp, s_q, h_q, True, variant)
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, False), (16, 2, True), (128, 1, True), (128, 2, False)])
@pytest.mark.parametrize("variant", [None, "wgmma", "standard"])
def test_mla_gpu_mixed(dtype, h_q, s_q, causal, variant):
    lens = [0, 1, 63, 64, 65, 1000, 20000, 4097, 0, 333, 70000, 128]
    inp = make_case(lens, s_q, h_q, dtype, "cuda")
    out, lse = _run_gpu(inp, s_q, h_q, causal, variant)
    _check_gpu(out, lse, inp, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [16, 128])
def test_mla_gpu_graph_replay(h_q):
    """Capture metadata + attention once, replay with new lengths: the result follows the lengths."""
    s_q, dtype = 1, torch.bfloat16
    inp = make_case([3000] * 6, s_q, h_q, dtype, "cuda")
    lens = inp.cache_seqlens.clone()
    graph, (out, lse) = captured(lambda: _run_gpu(inp, s_q, h_q, True))
    for new in ([3000] * 6, [1, 0, 2999, 64, 1500, 2000], [100] * 6):
        inp.cache_seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check_gpu(out, lse, inp, True)
    inp.cache_seqlens.copy_(lens)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["transposed", "standard", "wgmma"])
def test_mla_gpu_nan_tail_does_not_leak(variant):
    """Every slot past the lengths is NaN (make_case poisons them): outputs must stay finite."""
    inp = make_case([65, 130, 1, 32, 96], 1, 16, torch.bfloat16, "cuda")
    out, lse = _run_gpu(inp, 1, 16, False, variant)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _check_gpu(out, lse, inp, False)


@pytest.mark.gpu
def test_mla_gpu_wgmma_unaligned_cache_takes_the_tl_kernel():
    """A cache view whose base is not 16-byte aligned (TMA cannot address it) still gives the
    right answer (the call falls back to the tl kernel of the same orientation)."""
    inp = make_case([300, 70], 1, 64, torch.bfloat16, "cuda")
    flat = torch.empty(inp.k_cache.numel() + 1, dtype=inp.k_cache.dtype, device="cuda")
    shifted = flat[1:].view(inp.k_cache.shape)
    shifted.copy_(inp.k_cache)
    inp.k_cache = shifted
    assert shifted.data_ptr() % 16
    out, lse = _run_gpu(inp, 1, 64, True, "wgmma")
    _check_gpu(out, lse, inp, True)


@pytest.mark.parametrize("width,variant", [(576, "wgmma"), (584, "wgmma"), (580, "standard"), (577, "standard")])
def test_mla_q_strides_the_gluon_kernel_cannot_copy_take_the_tl_kernel(width, variant):
    """The plan of a wgmma call keeps the Gluon kernel only for q rows 8-element aligned (its
    16-byte cp.async copies of Q); other strides plan the tl kernel (no GPU needed: the plan
    only reads shapes and strides)."""
    inp = make_case([300, 70], 2, 16, torch.bfloat16, "cpu")
    q = torch.zeros(2, 2, 16, width, dtype=torch.bfloat16)[..., :576]
    meta, _ = op._metadata_torch(inp.cache_seqlens, 4)
    call = op._attention_call(q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "wgmma")
    assert call.variant == variant
    assert (call.fallback is not None) == (variant == "wgmma")    # a misaligned base still falls back per call


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["shifted", "width580", "width584"])
def test_mla_gpu_q_views(layout):
    """q views the Gluon kernel's 16-byte copies cannot address (base 2 bytes past alignment; rows
    580 elements apart) take the tl kernel; rows 584 apart (a multiple of 8: not contiguous, still
    16-byte aligned) stay on the Gluon kernel. Every one gives the right answer, s_q 2 causal so
    the (token, head) row strides both matter."""
    inp = make_case([300, 70, 129], 2, 16, torch.bfloat16, "cuda")
    b, s_q, h_q, d = inp.q.shape
    if layout == "shifted":
        flat = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype, device="cuda")
        view = flat[1:].view(inp.q.shape)
    else:
        width = int(layout[len("width"):])
        view = torch.empty(b, s_q, h_q, width, dtype=inp.q.dtype, device="cuda")[..., :d]
    view.copy_(inp.q)
    inp.q = view
    assert (view.data_ptr() % 16 != 0) == (layout == "shifted")
    assert view.is_contiguous() == (layout == "shifted")
    out, lse = _run_gpu(inp, s_q, h_q, True, "wgmma")
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
def test_mla_gpu_default_is_wgmma_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    assert op.kernel_status(torch.device("cuda"))["wgmma"] == "ok"
    q = torch.empty(1, 1, 128, 576, dtype=torch.bfloat16, device="cuda")
    assert op.choose_variant(128, 64, q) == "wgmma"
    assert op.choose_variant(128, 64, q.float()) == "standard"      # fp32: the tl kernel
    with tilefuse.force(variant="wgmma"):
        assert op.choose_variant(16, 64, q) == "wgmma"
        assert op.choose_variant(128, 64, q.float()) == "standard"


@pytest.mark.parametrize("key,variant", [("transposed", "transposed"), ("standard_small", "standard"),
                                         ("standard", "standard")])
@pytest.mark.gpu
def test_mla_gpu_unfused_combine(monkeypatch, key, variant):
    """The second-launch combine (a sweep candidate) with each kernel, on mixed lengths."""
    from tilefuse.ops.mla import configs

    configs.launch_config.cache_clear()
    monkeypatch.setitem(configs.CONFIGS, key, dict(configs.CONFIGS[key], fused_combine=False))
    h_q = 128 if key == "standard" else 16
    inp = make_case([0, 1, 65, 20000, 4097, 333, 70000, 128], 1, h_q, torch.bfloat16, "cuda")
    try:
        out, lse = _run_gpu(inp, 1, h_q, True, variant)
    finally:
        monkeypatch.undo()
        configs.launch_config.cache_clear()
    _check_gpu(out, lse, inp, True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,stages", [(64, 2), (32, 4)])
@pytest.mark.parametrize("h_q,s_q", [(16, 2), (128, 1)])
def test_mla_gpu_wgmma_ring_shapes(monkeypatch, block_n, stages, h_q, s_q):
    """The Gluon kernel at both ring shapes, on mixed lengths (0 to 70000: splits of 0, 1, 2 and
    many tiles, odd and even counts) with NaN past them."""
    variant = "wgmma"
    configs.launch_config.cache_clear()
    monkeypatch.setitem(configs.CONFIGS, variant, dict(configs.CONFIGS[variant], BLOCK_N=block_n, STAGES=stages))
    inp = make_case([0, 1, 63, 64, 65, 20000, 4097, 333, 70000, 128], s_q, h_q, torch.bfloat16, "cuda")
    try:
        out, lse = _run_gpu(inp, s_q, h_q, True, variant)
    finally:
        monkeypatch.undo()
        configs.launch_config.cache_clear()
    _check_gpu(out, lse, inp, True)


def test_explain_names_the_kernel_and_its_settings(interpret):
    inp = make_case([90, 33], 1, 16, torch.float16, interpret)
    choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, *inp.args())
    assert choice.family == "mla" and choice.variant == op.choose_variant(16, inp.block_table.shape[1], inp.q)
    assert choice.config == configs.launch_config(choice.variant, 16, inp.block_table.shape[1])[0]
    with tilefuse.force(variant="transposed"):
        forced = tilefuse.explain("flash_mla_with_kvcache", *inp.args())
    assert (forced.variant, forced.source) == ("transposed", "forced")
    # with the call's metadata it says what the combine does (configs.combine_settings)
    for parts, chunk in ((24, 32), (4, 8)):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=parts)
        source = tilefuse.explain(tilefuse.flash_mla_with_kvcache, *inp.args(), 512, meta, splits).source
        assert f"reads {chunk} partials per load ({parts} parts over 2 requests" in source, source
        assert "1 query row(s) per program" in source and "combine" not in choice.source


# ----------------------------------------------------------------------------- the cache writers
def test_fp8_layout_round_trip_and_bytes():
    """mla_quantize_kv / mla_dequantize_kv: 656 bytes per token (512 e4m3, 4 fp32 scales, 64 bf16
    RoPE); power-of-two scales as FlashMLA quantizes; dequantized within e4m3's rounding: half an
    ulp, 2^-4 relative for normal codes, and 2^-10 of the group's scale for subnormal ones; the
    RoPE part exact in bf16; FlashMLA's float8_e4m3fn view of the bytes read alike; an all-zero
    group exact."""
    from tilefuse.ops.mla.reference import FP8_KV_BYTES

    x = torch.randn(7, 3, 576) * torch.logspace(-3, 3, 7)[:, None, None]
    x[0, 0, 128:256] = 0.0
    packed = tilefuse.mla_quantize_kv(x)
    assert packed.shape == (7, 3, FP8_KV_BYTES) and packed.dtype == torch.uint8
    scales = packed[..., 512:528].contiguous().view(torch.float32)
    groups = x[..., :512].reshape(7, 3, 4, 128)
    # powers of two, the smallest >= amax / 448 (and >= 1e-4: 2^-13 for the zero group)
    assert torch.equal(scales, torch.exp2(torch.round(torch.log2(scales))))
    amax = groups.abs().amax(-1)
    assert (scales >= amax / 448).all() and ((scales / 2 < amax / 448) | (scales == 2 ** -13)).all()
    assert scales[0, 0, 1] == 2 ** -13
    assert torch.equal(packed[..., 528:].contiguous().view(torch.bfloat16), x[..., 512:].bfloat16())
    back = tilefuse.mla_dequantize_kv(packed, torch.float32)
    err = (back[..., :512] - x[..., :512]).abs().reshape(7, 3, 4, 128)
    bound = torch.maximum(groups.abs() * 2 ** -4, scales[..., None] * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all()
    assert (back[0, 0, 128:256] == 0).all()
    assert torch.equal(tilefuse.mla_dequantize_kv(packed.view(torch.float8_e4m3fn), torch.float32), back)
    assert tilefuse.mla_dequantize_kv(packed).dtype == torch.bfloat16


@pytest.mark.parametrize("bad,match", [
    (lambda: tilefuse.mla_quantize_kv(torch.randn(3, 512)), r"latent: expected \[\.\.\., 576\]"),
    (lambda: tilefuse.mla_quantize_kv(torch.full((2, 576), float("inf")), check_contents=True),
     "latent: expected finite"),
    (lambda: tilefuse.mla_quantize_kv(torch.zeros(2, 576, dtype=torch.int32)), "latent: expected dtype"),
    (lambda: tilefuse.mla_dequantize_kv(torch.zeros(2, 576, dtype=torch.uint8)), r"k_cache: expected \[\.\.\., 656\]"),
    (lambda: tilefuse.mla_dequantize_kv(torch.zeros(2, 656, dtype=torch.uint8), torch.int8), "dtype: expected"),
])
def test_fp8_layout_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("fp8", [False, True])
def test_scatter_kv_into_pages(interpret, backend, fp8):
    """mla_scatter_kv: each token's latent lands in its slot (page * page_size + offset) of a bf16
    (fp16 in the interpreter) or FP8 cache; -1 slots and slots past the cache are skipped (the
    debug check refuses the latter); nothing else changes."""
    page, blocks = 16, 4
    width = 656 if fp8 else 576
    dtype = torch.uint8 if fp8 else torch.float16
    cache = torch.randint(0, 255, (blocks, page, 1, width), dtype=torch.uint8).to(dtype).to(interpret)
    before = cache.clone()
    latent = torch.randn(6, 576).to(torch.float16).to(interpret)
    slots = torch.tensor([3, -1, 17, 63, 40, blocks * page + 5], dtype=torch.int64, device=interpret)
    with tilefuse.force(backend=backend):
        tilefuse.mla_scatter_kv(latent, cache, slots, check_contents=False)
    rows, old = cache.view(-1, width), before.view(-1, width)
    want = tilefuse.mla_quantize_kv(latent) if fp8 else latent
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < rows.shape[0]:
            assert torch.equal(rows[slot], want[t]), (t, slot)
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[[3, 17, 63, 40]] = False
    assert torch.equal(rows[untouched.to(rows.device)], old[untouched.to(rows.device)])
    with pytest.raises(ValueError, match=r"slot_mapping: expected slots in \[0, 64\) or -1"):
        tilefuse.mla_scatter_kv(latent, cache, slots, check_contents=True)
    with pytest.raises(ValueError, match="k_cache: expected"):
        tilefuse.mla_scatter_kv(latent, cache[..., :100], slots)


@pytest.mark.gpu
def test_gpu_scatter_kv_compiled_per_alignment():
    """The scatter's cached launch is keyed on what Triton specializes on: a latent view 2 bytes
    off 16-byte alignment, after an aligned call of the same shape, gets a kernel of its own
    (reusing the aligned one would issue misaligned vector loads) and lands exactly."""
    cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([5, 70, 200], dtype=torch.int64, device="cuda")
    aligned = torch.randn(3, 576, device="cuda").bfloat16()
    tilefuse.mla_scatter_kv(aligned, cache, slots)
    odd = torch.randn(3 * 576 + 1, device="cuda").bfloat16()[1:].view(3, 576)
    assert odd.data_ptr() % 16
    tilefuse.mla_scatter_kv(odd, cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(-1, 576)[slots], odd)


def test_fp8_cache_decodes_through_its_dequantized_form(interpret):
    """A paged FP8 cache, dequantized, is what flash_mla_with_kvcache decodes: the same outputs as
    the fp64 reference on the dequantized cache (the FP8 kernel itself is not written yet)."""
    inp = make_case([70, 5], 1, 16, torch.float16, interpret, page_size=32, nan_tail=False)
    packed = tilefuse.mla_quantize_kv(inp.k_cache)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.float16)
    out, lse = _run(inp, True, 4)
    _check(out, lse, inp, True)


def _poison_unused_fp8_slots(packed, block_table, lens):
    """0xFF in every byte of the FP8 cache's unused slots (NaN as e4m3, as fp32 scales and as
    bf16): a kernel that reads one of them into a result fails the finiteness check."""
    page = packed.shape[1]
    used = torch.zeros(packed.shape[0] * page, dtype=torch.bool)
    for i, n in enumerate(lens):
        for t in range(n):
            used[int(block_table[i, t // page]) * page + t % page] = True
    flat = packed.view(-1, packed.shape[-1])
    flat[~used] = 255
    return packed


@pytest.mark.parametrize("lens,s_q,h_q,page,variant,parts", [
    ([0, 1, 63, 64, 65, 200], 1, 16, 64, "standard", 4),
    ([130, 70], 2, 16, 16, "standard", 8),
    ([150, 3], 1, 64, 32, "standard", 6),           # 64 rows: the 64-row tiles, fused combine
    ([257, 40], 1, 16, 128, "transposed", 3),
])
def test_fp8_dense_kernel_reads_the_656_byte_layout(interpret, lens, s_q, h_q, page, variant, parts):
    """The tl split kernels decode FlashMLA's FP8 layout themselves (is_fp8_kvcache=True with a
    pinned tl kernel): each tile's e4m3 values times their group's fp32 scale, rounded once to q's
    dtype, the bf16 RoPE part as is, so the result is the fp64 reference on the cache that
    mla_dequantize_kv gives (same tolerance as the 16-bit cache); NaN bytes in every unused slot
    never reach the output; the uint8 and float8_e4m3fn views of the bytes decode alike."""
    inp = make_case(lens, s_q, h_q, torch.float16, interpret, page_size=page, nan_tail=False)
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache), inp.block_table.cpu(), lens)
    with tilefuse.force(variant=variant):
        assert op.fp8_sparse_kernels_run(inp.q)
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1, num_sm_parts=parts)
        out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta,
                                                   splits, causal=True, is_fp8_kvcache=True)
        out8, _ = tilefuse.flash_mla_with_kvcache(inp.q, packed.view(torch.float8_e4m3fn), inp.block_table,
                                                  inp.cache_seqlens, 512, meta, splits, causal=True,
                                                  is_fp8_kvcache=True)
    assert torch.equal(out, out8)
    inp.k_cache = tilefuse.mla_dequantize_kv(packed, torch.float16)
    _check(out, lse, inp, True)


def test_fp8_and_sparse_kernels_run_by_default_on_the_triton_backend(interpret):
    """The dense FP8 and the sparse decode run their tl kernels wherever the tl kernels run (the
    Triton backend, a 16-bit q) without anything pinned; elsewhere the references."""
    q = torch.zeros(1, 1, 16, 576, dtype=torch.float16, device=interpret)
    assert configs.FP8_SPARSE_KERNELS
    with tilefuse.force(backend="triton"):
        assert op.fp8_sparse_kernels_run(q) and not op.fp8_sparse_kernels_run(q.float())
    with tilefuse.force(backend="reference"):
        assert not op.fp8_sparse_kernels_run(q)


@pytest.mark.parametrize("h_q,s_q,kernel", [(16, 1, None), (16, 2, "transposed"), (32, 1, "transposed"),
                                            (16, 3, "standard"), (40, 1, "standard"), (64, 1, "standard"),
                                            (128, 2, "standard")])
def test_fp8_dense_decode_takes_the_tl_rule_where_the_gluon_kernel_would_run(monkeypatch, h_q, s_q, kernel):
    """Where the Gluon kernel is the 16-bit default (Hopper) and the Gluon FP8 kernel cannot run
    (fp16 q here), an FP8 cache takes the tl kernels by rows: the small-rows choice at <= 16,
    transposed at 17-32 (one head tile), the standard kernel's 64-row tile above."""
    monkeypatch.setattr(op, "_wgmma_fits", lambda q: True)      # as on an H200 with a 16-bit q
    inp = make_case([100, 50], s_q, h_q, torch.float16, "cpu", page_size=64, nan_tail=False)
    packed = tilefuse.mla_quantize_kv(inp.k_cache)
    with tilefuse.force(backend="triton"):
        assert op.choose_variant(s_q * h_q, inp.block_table.shape[1], inp.q) in configs.GLUON_VARIANTS
        choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, inp.q, packed, inp.block_table, inp.cache_seqlens, 512,
                                  is_fp8_kvcache=True)
    expected = kernel or configs.SMALL_ROWS_VARIANT[configs.regime(inp.block_table.shape[1])]
    assert choice.variant == expected


# ----------------------------------------------------------------------------- FP8 and sparse decode
def _slots(inp, i, tokens):
    """Cache slots (page * page_size + offset) of request i's tokens."""
    page = inp.k_cache.shape[1]
    return [int(inp.block_table[i, t // page]) * page + t % page for t in tokens]


def _sparse(inp, per_request, topk):
    idx = torch.full((inp.q.shape[0], inp.q.shape[1], topk), -1, dtype=torch.int32)
    for i, tokens in enumerate(per_request):
        idx[i, :, :len(tokens)] = torch.tensor(_slots(inp, i, tokens), dtype=torch.int32)
    return idx


def test_sparse_decode_of_every_token_is_the_dense_decode():
    """indices naming every token of each request (in any order, with -1 padding) give the dense
    non-causal decode; NaN in the unselected slots never leaks."""
    inp = make_case([40, 33], 1, 8, torch.float32, "cpu", page_size=16)
    dense = mla_decode_reference(*inp.args(), 512, compute_dtype=torch.float64)
    tokens = [list(range(40))[::-1], list(range(33))]
    for topk in (40, 64):
        idx = _sparse(inp, tokens, topk)
        out, lse = tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, 512, None, None, indices=idx)
        assert_close(out, dense[0].float(), atol=1e-5, rtol=1e-5)
        assert_close(lse, dense[1].float(), atol=1e-5, rtol=1e-5, name="lse")


def test_sparse_decode_topk_length_sink_extra_and_empty_rows():
    from tilefuse.ops.mla.reference import mla_sparse_decode_reference as sparse

    inp = make_case([64, 64], 2, 4, torch.float32, "cpu", page_size=32)
    idx = _sparse(inp, [list(range(0, 64, 3)), list(range(5, 60, 2))], 32)
    out, lse = sparse(inp.q, inp.k_cache, idx)
    # topk_length k: the first k indices only
    length = torch.tensor([7, 0], dtype=torch.int32)
    cut = idx.clone()
    cut[0, :, 7:] = -1
    cut[1] = -1
    o1, l1 = sparse(inp.q, inp.k_cache, idx, topk_length=length)
    o2, l2 = sparse(inp.q, inp.k_cache, cut)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert (o1[1] == 0).all() and torch.isinf(l1[1]).all() and (l1[1] > 0).all()   # no token: 0, +inf
    # the sink scales the output by exp(lse) / (exp(lse) + exp(sink)), leaves lse alone
    sink = torch.tensor([0.5, float("inf"), float("-inf"), -3.0])
    o3, l3 = sparse(inp.q, inp.k_cache, idx, attn_sink=sink)
    factor = 1 / (1 + torch.exp(sink[None, :, None] - lse))                       # [b, h, s_q]
    assert torch.equal(l3, lse)
    assert_close(o3, out * factor.permute(0, 2, 1)[..., None], atol=1e-6, rtol=1e-6)
    assert (o3[:, :, 1] == 0).all() and torch.equal(o3[:, :, 2], out[:, :, 2])
    # a second cache: its tokens join the same softmax
    half = idx.shape[-1] // 2
    o4, l4 = sparse(inp.q, inp.k_cache, idx[..., :half], extra_k_cache=inp.k_cache, extra_indices=idx[..., half:])
    assert_close(o4, out, atol=1e-5, rtol=1e-5)
    assert_close(l4, lse, atol=1e-5, rtol=1e-5, name="lse")
    # indices outside the cache attend to nothing
    wild = idx.clone()
    wild[..., -1] = 10 ** 6
    o5, _ = sparse(inp.q, inp.k_cache, wild)
    o6, _ = sparse(inp.q, inp.k_cache, torch.where(wild == 10 ** 6, -1, wild))
    assert torch.equal(o5, o6)


def test_fp8_cache_dense_and_sparse_decode_read_the_dequantized_values():
    """is_fp8_kvcache=True: the decode of the FP8 cache is the decode of its dequantized values,
    dense (block table, causal) and sparse."""
    inp = make_case([50, 20], 2, 16, torch.bfloat16, "cpu", page_size=16, nan_tail=False)
    packed = tilefuse.mla_quantize_kv(inp.k_cache)
    deq = tilefuse.mla_dequantize_kv(packed, torch.float32)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 32, 1)
    out, lse = tilefuse.flash_mla_with_kvcache(inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits,
                                               causal=True, is_fp8_kvcache=True)
    ro, rl = mla_decode_reference(inp.q.float(), deq, inp.block_table, inp.cache_seqlens, 512, causal=True)
    assert_close(out.float(), ro, atol=1e-2, rtol=1e-2)
    assert_close(lse, rl, atol=1e-4, rtol=1e-4, name="lse")
    idx = _sparse(inp, [list(range(50)), list(range(20))], 64)
    so, sl = tilefuse.flash_mla_with_kvcache(inp.q, packed.view(torch.float8_e4m3fn), None, None, 512, None, None,
                                             is_fp8_kvcache=True, indices=idx)
    assert_close(sl, tilefuse.flash_mla_with_kvcache(inp.q.float(), deq, None, None, 512, None, None,
                                                     indices=idx)[1], atol=1e-4, rtol=1e-4, name="lse")
    assert so.dtype == torch.bfloat16 and so.shape == (2, 2, 16, 512)


def _sparse_kernel_case(s_q, h_q, fp8, page, seed, device="cpu"):
    """Random top-k lists over a paged cache with NaN in every unwritten slot (FP8: 0xFF bytes):
    -1 entries, indices past the cache, repeated tokens, a topk_length per request (one 0), a
    second cache with its own lists, and a sink per head (one +inf, one -inf); built on the CPU,
    returned on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lens = [300, 77, 5]
    inp = make_case(lens, s_q, h_q, torch.float16, "cpu", page_size=page, nan_tail=not fp8)
    cache = inp.k_cache
    if fp8:
        cache = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache.nan_to_num(0.0)),
                                         inp.block_table, lens)
    topk = 150
    idx = torch.full((3, s_q, topk), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        for t in range(s_q):
            picked = torch.randint(0, n, (min(n, 120),), generator=gen).tolist()
            idx[i, t, :len(picked)] = torch.tensor(_slots(inp, i, picked), dtype=torch.int32)
    idx[0, 0, 130] = cache.shape[0] * page + 7               # outside the cache: attends to nothing
    length = torch.tensor([140, 0, 150], dtype=torch.int32)
    extra_lens = [40, 40, 40]
    extra = make_case(extra_lens, s_q, h_q, torch.float16, "cpu", page_size=page, nan_tail=not fp8)
    extra_cache = (_poison_unused_fp8_slots(tilefuse.mla_quantize_kv(extra.k_cache.nan_to_num(0.0)),
                                            extra.block_table, extra_lens) if fp8 else extra.k_cache)
    extra_idx = torch.stack([torch.tensor([_slots(extra, i, list(range(0, 40, 3)))] * s_q, dtype=torch.int32)
                             for i in range(3)])
    sink = torch.randn(h_q, generator=gen)
    sink[0], sink[-1] = float("inf"), float("-inf")
    return tuple(t.to(device) for t in (inp.q, cache, idx, length, extra_cache, extra_idx, sink))


@pytest.mark.parametrize("s_q,h_q,fp8,page", [(1, 16, False, 64), (2, 16, True, 16), (1, 128, True, 64),
                                              (1, 3, False, 32)])
@pytest.mark.parametrize("extra,sink", [(False, False), (True, True)])
def test_sparse_kernel_against_the_reference(interpret, s_q, h_q, fp8, page, extra, sink):
    """The sparse tl kernel (pinned) against the fp64 reference, 16-bit and FP8 caches: every
    index rule (-1, outside the cache, topk_length, 0 length), a second cache in the same softmax,
    the sink (+inf: output 0), heads from 3 to 128 (two 64-head tiles), 1-2 query tokens; NaN in
    every unwritten slot never reaches the output."""
    q, cache, idx, length, extra_cache, extra_idx, sinks = _sparse_kernel_case(s_q, h_q, fp8, page,
                                                                               seed=h_q + s_q, device=interpret)
    kwargs = dict(is_fp8_kvcache=fp8, indices=idx, topk_length=length)
    if extra:
        kwargs.update(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_idx)
    if sink:
        kwargs["attn_sink"] = sinks
    with tilefuse.force(backend="triton", variant="standard"):
        assert op.fp8_sparse_kernels_run(q)
        assert tilefuse.explain("flash_mla_with_kvcache", q, cache, None, None, 512, **kwargs).variant == "sparse"
        out, lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, **kwargs)
    ro, rl = mla_sparse_decode_reference(q, cache, idx, topk_length=length, attn_sink=kwargs.get("attn_sink"),
                                         extra_k_cache=kwargs.get("extra_k_cache"),
                                         extra_indices=kwargs.get("extra_indices_in_kvcache"),
                                         compute_dtype=torch.float64)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))          # heads with no token: +inf exactly
    assert_close(out, ro, atol=4e-3, rtol=4e-3)
    finite = torch.isfinite(rl)
    assert_close(lse[finite], rl[finite].float(), atol=2e-3, rtol=1e-4, name="lse")


@pytest.mark.parametrize("fp8,page", [(True, 16), (False, 64)])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("programs_per_sm", [4, 10 ** 6], ids=["few-parts", "32-position-parts"])
def test_sparse_gather_packs_the_selected_tokens(interpret, monkeypatch, fp8, page, extra, programs_per_sm):
    """``op.gather_selected`` (the gather of the sparse decode's gather + dense path) against the
    reference's selection: each query token's selected tokens, in list order (the second cache's
    after the first's), dequantized, packed from the start of its rows, their count as its
    length; -1, indices outside the cache, positions past topk_length (a 0 included) and NaN bytes
    in unwritten slots never reach a written row. A later query-token group (``first``) too; the
    list in one part or in parts of 32 positions (each counting the selected tokens before it)."""
    monkeypatch.setattr(configs, "SPARSE_GATHER_PROGRAMS_PER_SM", programs_per_sm)
    q, cache, idx, length, extra_cache, extra_idx, _ = _sparse_kernel_case(2, 4, fp8, page, seed=5, device=interpret)
    sources = [(cache, idx, length)] + ([(extra_cache, extra_idx, None)] if extra else [])
    pages = -(-sum(i.shape[-1] for _, i, _ in sources) // 64)
    for first, count in ((0, 6), (3, 2)):
        dense, seqlens = op.gather_selected(sources, 2, first, count, pages, torch.float16)
        for u in range(count):
            b, t = divmod(first + u, 2)
            rows = []
            for src, ind, ln in sources:
                flat = src.reshape(-1, src.shape[-1]).cpu()
                for pos, i in enumerate(ind[b, t].tolist()):
                    if 0 <= i < flat.shape[0] and (ln is None or pos < int(ln[b])):
                        rows.append(flat[i])
            assert int(seqlens[u]) == len(rows)
            if rows:
                want = torch.stack(rows)
                want = dequantize_kv_reference(want, torch.float16) if fp8 else want
                got = dense[u * pages * 64: u * pages * 64 + len(rows)].cpu()
                assert torch.equal(got, want)


def test_sparse_gather_block_table_is_one_growing_tensor(monkeypatch):
    """Gather + dense's block table: query token u owns pages u x pages ..., for any count; one
    cached tensor per page count, grown to a power of two (a serving run's batch sizes do not pile
    up tables)."""
    monkeypatch.setattr(op, "_unit_tables", {})
    cpu = torch.device("cpu")
    for units, pages in [(3, 4), (5, 4), (2, 4), (9, 4), (1, 32)]:
        table = op._unit_pages(cpu, units, pages)
        assert table.dtype == torch.int32 and table.is_contiguous()
        assert torch.equal(table, torch.arange(units * pages, dtype=torch.int32).view(units, pages))
    assert {key[-1]: t.shape for key, t in op._unit_tables.items()} == {4: (16, 4), 32: (1, 32)}


@pytest.mark.gpu
def test_sparse_gather_block_table_per_stream():
    """Two streams never share the cached table: one stream writes it, and growing it frees the old
    tensor, so a shared table could be read before it is written or after its memory is reused."""
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    main_table = op._unit_pages(dev, 3, 4)
    with torch.cuda.stream(side):
        side_table = op._unit_pages(dev, 3, 4)
    assert main_table.data_ptr() != side_table.data_ptr()
    torch.cuda.synchronize()
    assert torch.equal(main_table, side_table)


def test_sparse_gather_dense_cost_model():
    """The pick between the Gluon sparse kernel and gather + dense: never with one head tile (<= 32
    heads), at 128 heads from small batches on, at 64 heads only for large ones (the fit's
    benchmark points: b16 -> sparse kernel, b128 -> gather + dense), monotone in the positions."""
    pays = configs.sparse_gather_dense_pays
    assert not any(pays(h, n) for h in (1, 8, 16, 32) for n in (1, 10 ** 5, 10 ** 8))
    assert pays(128, 16 * 2048) and pays(128, 128 * 2048) and not pays(128, 1000)
    assert not pays(64, 16 * 2048) and not pays(64, 32 * 2048) and pays(64, 128 * 2048)
    for h in (48, 64, 96, 128):
        for eager in (False, True):
            picks = [pays(h, n, eager) for n in range(0, 10 ** 6, 5000)]
            assert picks == sorted(picks), h      # once worth it, worth it for every larger batch
    # eager: the host's floor keeps batch 16 at 128 heads on the one-launch sparse kernel (measured
    # 84 against 147 us eager there), batch 128 still gathers
    assert not pays(128, 16 * 2048, eager=True) and pays(128, 128 * 2048, eager=True)
    assert all(pays(h, n, True) <= pays(h, n) for h in (48, 64, 128) for n in range(0, 10 ** 6, 5000))


@pytest.mark.parametrize("tiles,programs,expect", [
    (32, 16, 4),      # 16 query tokens: 8 parts each -> 128 programs, one round on 132 SMs
    (32, 32, 8),      # 32: 4 parts each (5 would make 160 programs, two rounds)
    (32, 128, 32),    # 128: one part each
    (32, 1, 1),       # one token: the list spread over 32 SMs
    (1, 500, 1),      # a single tile
])
def test_gluon_sparse_parts_fill_whole_waves(tiles, programs, expect):
    """The Gluon sparse kernel's part size: the fewest rounds of one program per SM, times the
    part's tiles plus its fixed cost, the longer part on a tie; capped by the SMEM index list."""
    assert configs.gluon_sparse_part_tiles(tiles, programs, 132, 32) == expect
    assert configs.gluon_sparse_part_tiles(64, 128, 132, 32) <= 32


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,h_q,page", [(1, 16, 64), (2, 16, 16), (1, 128, 64), (1, 3, 32), (2, 40, 64)])
@pytest.mark.parametrize("extra,sink", [(False, False), (True, True)])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_gpu_sparse_gluon_kernel_edge_cases(s_q, h_q, page, extra, sink, num_warps, monkeypatch):
    """The Gluon sparse kernel (the FP8 default on Hopper) on every index rule of
    ``_sparse_kernel_case`` (-1, outside the cache, repeats, topk_length with a 0, a second cache,
    a +-inf sink, NaN bytes in every unwritten slot), heads 3-128 (40: a partly empty second
    tile), one warpgroup or two (each half of a tile's heads): the fp64 reference on the
    dequantized cache, to the 16-bit path's tolerances."""
    monkeypatch.setattr(configs, "SPARSE_GATHER_DENSE", False)     # this kernel at every head count
    for bound, cfg in list(configs.GLUON_SPARSE_CONFIGS.items()):
        monkeypatch.setitem(configs.GLUON_SPARSE_CONFIGS, bound,
                            dict(cfg, num_warps=num_warps, BLOCK_H=max(cfg["BLOCK_H"], 2 * num_warps)))
    q, cache, idx, length, extra_cache, extra_idx, sinks = (
        _sparse_kernel_case(s_q, h_q, True, page, seed=7 * h_q + s_q, device="cuda"))
    q = q.to(torch.bfloat16)
    kwargs = dict(is_fp8_kvcache=True, indices=idx, topk_length=length)
    if extra:
        kwargs.update(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_idx)
    if sink:
        kwargs["attn_sink"] = sinks
    assert tilefuse.explain("flash_mla_with_kvcache", q, cache, None, None, 512, **kwargs).config["kernel"] == "gluon"
    out, lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, **kwargs)
    ro, rl = mla_sparse_decode_reference(q, cache, idx, topk_length=length, attn_sink=kwargs.get("attn_sink"),
                                         extra_k_cache=kwargs.get("extra_k_cache"),
                                         extra_indices=kwargs.get("extra_indices_in_kvcache"),
                                         compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    finite = torch.isfinite(rl)
    assert_close(lse[finite], rl[finite].float(), atol=1e-3, rtol=1e-4, name="lse")


@pytest.mark.parametrize("kwargs,match", [
    (dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), causal=True), "causal: expected False with indices"),
    (dict(indices=torch.zeros(2, 3, 4, dtype=torch.int32)), r"indices: expected \[b=2, s_q=1, topk\]"),
    (dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), attn_sink=torch.zeros(3)), r"attn_sink: expected shape"),
    (dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), topk_length=torch.zeros(3, dtype=torch.int32)),
     "topk_length: expected shape"),
    (dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), extra_indices_in_kvcache=torch.zeros(2, 1, 4, dtype=torch.int32)),
     "extra_k_cache, extra_indices_in_kvcache: expected both"),
    (dict(is_fp8_kvcache=True), r"k_cache: expected \[num_blocks, page, 1, 656\]"),
])
def test_fp8_and_sparse_errors(kwargs, match):
    inp = make_case([40, 20], 1, 16, torch.float32, "cpu", page_size=16)
    with pytest.raises(ValueError, match=match):
        tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, None, None,
                                        **kwargs)


# ------------------------------------------------------------ argument checks of every path
def _fp8_dense_args(device, lens=(100, 20), s_q=1, h_q=16, page=64):
    """An FP8 dense decode's arguments (fp16 q, packed cache, block table, lengths, metadata)."""
    inp = make_case(list(lens), s_q, h_q, torch.float16, device, page_size=page, nan_tail=False)
    packed = tilefuse.mla_quantize_kv(inp.k_cache)
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, s_q * h_q, 1, num_sm_parts=4)
    return inp, packed, meta, splits


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("bad", ["length", "page"])
def test_fp8_dense_check_contents(interpret, backend, bad):
    """check_contents=True reads an FP8 dense decode's lengths and block table as it does a 16-bit
    one's: a length past the block table's capacity (200 > 2 pages of 64) or a -1 page in a used
    slot raise ValueError; without the check the kernel stays in bounds."""
    inp, packed, meta, splits = _fp8_dense_args(interpret)
    lens, table = inp.cache_seqlens.clone(), inp.block_table.clone()
    if bad == "length":
        lens[0] = 200
    else:
        table[0, 1] = -1
    match = "cache_seqlens: expected lengths in" if bad == "length" else "block_table: expected pages in"
    with tilefuse.force(backend=backend):
        with pytest.raises(ValueError, match=match):
            tilefuse.flash_mla_with_kvcache(inp.q, packed, table, lens, 512, meta, splits, causal=True,
                                            is_fp8_kvcache=True, check_contents=True)
        with pytest.raises(ValueError, match=match):      # the same check on the 16-bit cache
            tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, table, lens, 512, meta, splits, causal=True,
                                            check_contents=True)
        if backend == "triton":
            out, _ = tilefuse.flash_mla_with_kvcache(inp.q, packed, table, lens, 512, meta, splits, causal=True,
                                                     is_fp8_kvcache=True, check_contents=False)
            assert out.shape == (2, 1, 16, 512)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("name", ["attn_sink", "topk_length", "extra_topk_length", "extra_k_cache",
                                  "extra_indices_in_kvcache"])
def test_sparse_only_arguments_are_refused_on_a_dense_call(fp8, name):
    """attn_sink, topk_length and the second cache's arguments mean something only with indices: a
    dense decode (16-bit or FP8 cache) that gets one raises ValueError naming it instead of ignoring it."""
    inp, packed, meta, splits = _fp8_dense_args("cpu")
    value = dict(attn_sink=torch.zeros(16), topk_length=torch.zeros(2, dtype=torch.int32),
                 extra_topk_length=torch.zeros(2, dtype=torch.int32), extra_k_cache=packed if fp8 else inp.k_cache,
                 extra_indices_in_kvcache=torch.zeros(2, 1, 4, dtype=torch.int32))[name]
    args = (inp.q, packed if fp8 else inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta, splits)
    with pytest.raises(ValueError, match=f"^{name}: expected None in a dense decode"):
        tilefuse.flash_mla_with_kvcache(*args, is_fp8_kvcache=fp8, **{name: value})
    with pytest.raises(ValueError, match=f"^{name}: expected None in a dense decode"):
        tilefuse.explain(tilefuse.flash_mla_with_kvcache, *args, is_fp8_kvcache=fp8, **{name: value})


def test_extra_topk_length_without_a_second_cache_is_refused():
    inp = make_case([40, 20], 1, 16, torch.float32, "cpu", page_size=16)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="^extra_topk_length: expected None without extra_k_cache"):
        tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, 512, None, None, indices=idx,
                                        extra_topk_length=torch.zeros(2, dtype=torch.int32))


def test_sparse_decode_refuses_bf16_in_the_interpreter(interpret):
    """The interpreter computes bf16 dots wrongly: the sparse decode refuses a bf16 q there as the
    dense one does (it returned |out| ~ 1e9), and explain with it."""
    if interpret.type != "cpu":
        pytest.skip("the interpreter only")
    q, cache, idx, length, *_ = _sparse_kernel_case(1, 16, True, 64, seed=1)
    for fp8, c in ((True, cache), (False, make_case([300, 77, 5], 1, 16, torch.bfloat16, "cpu").k_cache)):
        with pytest.raises(ValueError, match="q: bfloat16 is not supported in Triton's CPU interpreter"):
            tilefuse.flash_mla_with_kvcache(q.bfloat16(), c, None, None, 512, None, None, is_fp8_kvcache=fp8,
                                            indices=idx)
        with pytest.raises(ValueError, match="q: bfloat16 is not supported in Triton's CPU interpreter"):
            tilefuse.explain(tilefuse.flash_mla_with_kvcache, q.bfloat16(), c, None, None, 512, is_fp8_kvcache=fp8,
                             indices=idx)


def _explain_bad(kind):
    inp, packed, meta, splits = _fp8_dense_args("cpu")
    args = dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=meta, num_splits=splits)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    if kind == "q_rank3":
        args["q"] = inp.q[:, 0]
    elif kind == "q_int32":
        args["q"] = inp.q.to(torch.int32)
    elif kind == "page48":
        args["k_cache"] = inp.k_cache[:, :48]
    elif kind == "head_dim_v":
        args["head_dim_v"] = 7
    elif kind == "indices_int16":
        args.update(indices=idx.to(torch.int16))
    elif kind == "no_block_table":
        args["block_table"] = None
    elif kind == "fp8_page48":
        args.update(k_cache=packed[:, :48], is_fp8_kvcache=True)
    elif kind == "sparse_head_dim_v":
        args.update(indices=idx, head_dim_v=7)
    return args


@pytest.mark.parametrize("kind,match", [
    ("q_rank3", "q: expected 4 dimensions"), ("q_int32", "q: expected dtype"), ("page48", "k_cache: expected"),
    ("head_dim_v", "head_dim_v: expected 512"), ("indices_int16", "indices: expected dtype"),
    ("no_block_table", "block_table: expected a torch.Tensor"), ("fp8_page48", "k_cache: expected"),
    ("sparse_head_dim_v", "head_dim_v: expected 512"),
])
def test_explain_refuses_what_the_op_refuses(kind, match):
    """tilefuse.explain runs the op's own checks first: an input the op refuses raises the same
    ValueError there (it returned a decision for them)."""
    with pytest.raises(ValueError, match=match) as from_op:
        tilefuse.flash_mla_with_kvcache(**_explain_bad(kind))
    with pytest.raises(ValueError, match=match) as from_explain:
        tilefuse.explain(tilefuse.flash_mla_with_kvcache, **_explain_bad(kind))
    assert str(from_op.value) == str(from_explain.value)


# ----------------------------------------------------------------------------- zero tokens
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch,s_q", [(0, 1), (2, 0)])
def test_sparse_decode_of_no_token(interpret, backend, fp8, batch, s_q):
    """A sparse decode with no query token (batch 0 or s_q 0) returns empty outputs of the
    reference's shapes (it raised ZeroDivisionError); explain says nothing runs."""
    q, cache, idx, *_ = _sparse_kernel_case(1, 16, fp8, 64, seed=2, device=interpret)
    q, idx = q[:batch, :s_q], idx[:batch, :s_q]
    with tilefuse.force(backend=backend):
        out, lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, is_fp8_kvcache=fp8,
                                                   indices=idx)
        choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, q, cache, None, None, 512, is_fp8_kvcache=fp8,
                                  indices=idx)
    ro, rl = mla_sparse_decode_reference(q, cache, idx)
    assert out.shape == ro.shape == (batch, s_q, 16, 512) and lse.shape == rl.shape == (batch, 16, s_q)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and choice.variant == "reference"


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fp8_dense_decode_of_an_empty_batch(interpret, backend):
    inp, packed, _, _ = _fp8_dense_args(interpret)
    with tilefuse.force(backend=backend):
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens[:0], 16, 1, num_sm_parts=4)
        out, lse = tilefuse.flash_mla_with_kvcache(inp.q[:0], packed, inp.block_table[:0], inp.cache_seqlens[:0],
                                                   512, meta, splits, causal=True, is_fp8_kvcache=True)
        choice = tilefuse.explain(tilefuse.flash_mla_with_kvcache, inp.q[:0], packed, inp.block_table[:0],
                                  inp.cache_seqlens[:0], 512, meta, splits, is_fp8_kvcache=True)
    assert out.shape == (0, 1, 16, 512) and lse.shape == (0, 16, 1) and choice.variant == "reference"


# ------------------------------------------------------------------ fp16 q over an FP8 cache
def test_fp8_quantizer_keeps_fp16_latents_within_fp16():
    """An fp16 latent of +-65504 (fp16's largest) dequantizes within fp16's range: e4m3 x scale and
    the bf16 RoPE value round to 65536 both, so those round one code toward zero instead (the
    nearest representable value at most 65504); other values as before."""
    x = torch.randn(4, 576).to(torch.float16)
    x[0], x[1, :300], x[2, 510:] = 65504, -65504, 65504
    back = tilefuse.mla_dequantize_kv(tilefuse.mla_quantize_kv(x), torch.float32)
    assert torch.isfinite(back.half()).all() and back.abs().max() <= 65504
    assert (back[0] == torch.tensor([61440.0] * 512 + [65280.0] * 64)).all()     # one code below 65536
    fp32 = tilefuse.mla_dequantize_kv(tilefuse.mla_quantize_kv(x[3:].float()), torch.float32)
    assert torch.equal(back[3:], fp32)          # ordinary values quantize as from fp32


def _fp16_overflow_case(device, page=16):
    """fp16 q over an FP8 cache whose values leave fp16's range where the reference stays finite:
    request 0's tokens 3 and 40 hold 70000 in their first 128 latent values (e4m3 x scale = 73728
    > 65504; q's first 128 values are -1 there, so their scores are far below the others and their
    weight is 0), token 20's RoPE part holds +-1e5 (bf16, > 65504); NaN bytes in unused slots."""
    lens = [70, 5]
    inp = make_case(lens, 1, 16, torch.float16, "cpu", page_size=page, nan_tail=False)
    latent = inp.k_cache.float()
    rows = latent.view(-1, 576)
    for t in (3, 40):
        rows[_slots(inp, 0, [t])[0], :128] = 70000.0
    rows[_slots(inp, 0, [20])[0], 512:] = 1e5 * torch.sign(torch.randn(64))
    inp.q[0, :, :, :128] = -1.0
    packed = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(latent), inp.block_table, lens)
    return inp, packed.to(device), inp.q.to(device)


def _fp16_overflow_run(device, variant):
    """The decode of :func:`_fp16_overflow_case` with ``variant`` pinned ("sparse": the sparse
    decode, the tl kernel) and its fp64 reference: ``(out, lse, ref_out, ref_lse)``."""
    inp, packed, q = _fp16_overflow_case(device)
    lens, table = inp.cache_seqlens.to(device), inp.block_table.to(device)
    with tilefuse.force(variant="standard" if variant == "sparse" else variant):
        if variant == "sparse":
            idx = _sparse(inp, [list(range(70)), list(range(5))], 80).to(device)
            out, lse = tilefuse.flash_mla_with_kvcache(q, packed, None, None, 512, None, None, is_fp8_kvcache=True,
                                                       indices=idx)
            return (out, lse, *mla_sparse_decode_reference(q, packed, idx, compute_dtype=torch.float64))
        meta, splits = tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=3)
        out, lse = tilefuse.flash_mla_with_kvcache(q, packed, table, lens, 512, meta, splits, is_fp8_kvcache=True)
        return (out, lse, *mla_decode_reference(q, packed, table, lens, 512, compute_dtype=torch.float64))


@pytest.mark.parametrize("variant", ["standard", "transposed", "sparse"])
def test_fp8_cache_with_fp16_query_never_overflows(interpret, variant):
    """An fp16 q over FP8 caches whose values pass fp16's 65504 (e4m3 x a large scale, bf16 RoPE
    values): the tl kernels (dense, both orientations; sparse) compute with the tile's shifts, so
    the result is the fp64 reference's (finite) where the fp16 conversion of the values gave NaN."""
    out, lse, ro, rl = _fp16_overflow_run(interpret, variant)
    assert torch.isfinite(ro).all() and torch.isfinite(out).all()
    assert_close(out, ro, atol=2e-3, rtol=2e-3)
    assert_close(lse, rl, atol=1e-3, rtol=1e-5, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["standard", "transposed", "sparse", None])
def test_gpu_fp8_cache_with_fp16_query_never_overflows(variant):
    """test_fp8_cache_with_fp16_query_never_overflows compiled (fp16 q: the tl kernels; None: the
    default dispatch, whichever kernel it picks for an fp16 q)."""
    out, lse, ro, rl = _fp16_overflow_run(torch.device("cuda"), variant)
    assert torch.isfinite(ro).all() and torch.isfinite(out).all()
    assert_close(out, ro, atol=1e-2, rtol=1e-2)
    assert_close(lse, rl, atol=1e-3, rtol=1e-5, name="lse")


# --------------------------------------------------------------- NaN in unused cache slots
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("path", ["fp8_dense", "fp8_sparse", "sparse"])
def test_nan_in_unused_slots_never_reaches_the_output(interpret, backend, path):
    """NaN in every slot a call does not attend (past the lengths, pages no request uses, rows its
    indices do not select; FP8: 0xFF bytes, NaN as codes, scales and RoPE) never reaches the output,
    on the kernels and the reference."""
    lens = [70, 5]
    inp = make_case(lens, 1, 16, torch.float16, "cpu", page_size=16, nan_tail=(path == "sparse"))
    cache = inp.k_cache
    if path != "sparse":
        cache = _poison_unused_fp8_slots(tilefuse.mla_quantize_kv(inp.k_cache), inp.block_table, lens)
    picks = [list(range(0, 70, 3)), [4, 1]]
    if path != "fp8_dense":      # the unselected rows too
        flat = cache.view(-1, cache.shape[-1])
        for i, tokens in enumerate(picks):
            skipped = [t for t in range(lens[i]) if t not in tokens]
            flat[_slots(inp, i, skipped)] = 255 if path == "fp8_sparse" else float("nan")
    cache, q = cache.to(interpret), inp.q.to(interpret)
    lens_d, table = inp.cache_seqlens.to(interpret), inp.block_table.to(interpret)
    with tilefuse.force(backend=backend):
        if path == "fp8_dense":
            meta, splits = tilefuse.get_mla_metadata(lens_d, 16, 1, num_sm_parts=3)
            out, lse = tilefuse.flash_mla_with_kvcache(q, cache, table, lens_d, 512, meta, splits, causal=True,
                                                       is_fp8_kvcache=True)
        else:
            idx = _sparse(inp, picks, 32).to(interpret)
            out, lse = tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None,
                                                       is_fp8_kvcache=path == "fp8_sparse", indices=idx)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ------------------------------------------------------------------ torch.compile, meta tensors
def _compile_cases(kind, lens=(70, 5)):
    """(step function, its tensor arguments) of each public MLA call for the compile tests (CPU),
    for requests of lengths ``lens``."""
    lens = list(lens)
    if kind == "get_mla_metadata":
        return (lambda lens: tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=4)), (torch.tensor(lens).int(),)
    if kind == "mla_quantize_kv":
        return (lambda x: tilefuse.mla_quantize_kv(x)), (torch.randn(len(lens), 7, 576).half(),)
    dtype = torch.bfloat16 if kind == "dense_bf16" else torch.float16
    inp = make_case(lens, 1, 16, dtype, "cpu", page_size=16, nan_tail=False)
    if kind in ("dense_bf16", "dense_fp16", "fp8_dense"):
        cache = tilefuse.mla_quantize_kv(inp.k_cache) if kind == "fp8_dense" else inp.k_cache

        def dense(q, k_cache, block_table, lens):
            meta, splits = tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=4)
            return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                                   is_fp8_kvcache=kind == "fp8_dense")
        return dense, (inp.q, cache, inp.block_table, inp.cache_seqlens)
    fp8 = kind == "fp8_sparse"
    cache = tilefuse.mla_quantize_kv(inp.k_cache) if fp8 else inp.k_cache
    idx = _sparse(inp, [list(range(0, n, 2)) for n in lens], 104)

    def sparse(q, k_cache, indices, length, sink):
        return tilefuse.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None, is_fp8_kvcache=fp8,
                                               indices=indices, topk_length=length, attn_sink=sink)
    return sparse, (inp.q, cache, idx, torch.tensor([30] * len(lens), dtype=torch.int32), torch.randn(16))


COMPILE_KINDS = ["dense_bf16", "dense_fp16", "fp8_dense", "sparse", "fp8_sparse", "get_mla_metadata",
                 "mla_quantize_kv"]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kind", COMPILE_KINDS)
def test_mla_compile_every_path(kind, dynamic):
    """Each public MLA call traces through its registered custom op under
    torch.compile(fullgraph=True), static and dynamic (one graph for two batch sizes: the checks'
    messages specialized the batch), compiled before any eager call (the FP8 and sparse decodes
    bypassed their ops and failed to compile); the compiled result equals the eager one (CPU:
    aot_eager, reference backend)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with tilefuse.force(backend="reference"):
        for lens in ((70, 5), (200, 64, 1)):      # dynamic=True: one graph for both batches
            step, args = _compile_cases(kind, lens)
            compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=counter)(*args)
            eager = step(*args)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0, equal_nan=True)
            if dynamic:
                assert counter.frame_count == 1, "dynamic=True recompiled for another batch (a size was specialized)"


@pytest.mark.parametrize("kind", ["dense_fp16", "fp8_dense", "sparse", "fp8_sparse"])
def test_mla_compile_runs_the_kernels_inside_the_ops(interpret, kind):
    """With the kernels (interpreted on the CPU) the decode must be an opaque custom op to
    torch.compile(fullgraph=True): a kernel launch traced by dynamo is a graph break (the FP8 and
    sparse decodes failed so)."""
    if interpret.type != "cpu":
        pytest.skip("the interpreter only (the GPU has test_gpu_mla_compile_every_path)")
    torch._dynamo.reset()
    step, args = _compile_cases(kind)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, step(*args), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("kind", COMPILE_KINDS)
def test_gpu_mla_compile_every_path(kind, dynamic):
    """test_mla_compile_every_path on the GPU with inductor (the kernels run inside the ops)."""
    torch._dynamo.reset()
    step, args = _compile_cases(kind)
    args = tuple(a.cuda() for a in args)
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)(*args)
    eager = step(*args)
    torch.testing.assert_close(compiled, eager, equal_nan=True)    # (the dtype's default tolerance)


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_sparse_and_quantizer_on_meta_tensors(fp8):
    """Meta inputs give the outputs' shapes (mla_quantize_kv read its values: .item() on a meta
    tensor); indices alone on another device is refused naming them."""
    q, cache, idx, length, _, _, sink = _sparse_kernel_case(1, 16, fp8, 64, seed=4)
    packed = tilefuse.mla_quantize_kv(torch.randn(5, 576, device="meta"), check_contents=True)
    assert packed.shape == (5, 656) and packed.dtype == torch.uint8 and packed.is_meta
    assert tilefuse.mla_dequantize_kv(packed).shape == (5, 576)
    tilefuse.mla_scatter_kv(torch.randn(3, 576, device="meta"), torch.zeros(4, 16, 1, 656, dtype=torch.uint8,
                            device="meta"), torch.zeros(3, dtype=torch.int64, device="meta"), check_contents=True)
    out, lse = tilefuse.flash_mla_with_kvcache(q.to("meta"), cache.to("meta"), None, None, 512, None, None,
                                               is_fp8_kvcache=fp8, indices=idx.to("meta"),
                                               topk_length=length.to("meta"), attn_sink=sink.to("meta"))
    assert out.shape == (3, 1, 16, 512) and out.is_meta and lse.shape == (3, 16, 1) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="indices: expected a tensor on cpu"):
        tilefuse.flash_mla_with_kvcache(q, cache, None, None, 512, None, None, is_fp8_kvcache=fp8,
                                        indices=idx.to("meta"))


# ---------------------------------------------------------------------------------------------
# The Gluon kernel's per-call levers (configs.WGMMA_LEVERS): the fused combine (FUSED_SPLITS),
# Q issued ahead (Q_AHEAD), programmatic dependent launches (PDL), the seesaw form (SEESAW).

LEVERS = {
    "fused16": dict(FUSED_SPLITS=16),
    "fusedall_pdl1": dict(FUSED_SPLITS=1 << 20, PDL=1),
    "qahead": dict(Q_AHEAD=True),
    "seesaw": dict(SEESAW=1),
    "pdl2": dict(PDL=2),
    "every": dict(FUSED_SPLITS=16, Q_AHEAD=True, PDL=2),
    "combine32x4": dict(COMBINE_S_CHUNK=32, COMBINE_COL_BLOCKS=4),
    "combine32": dict(COMBINE_S_CHUNK=32),        # the rule's pick for few long requests, on every batch
    "combine_rows4": dict(COMBINE_ROWS=4),        # 4 query rows per combine program (off)
}


def test_wgmma_levers_plan():
    """The plan each lever makes (no GPU: planning reads shapes only): arrival counters per
    (request, head tile) only with the fused combine, no combine launch where every request is
    fused (FUSED_SPLITS at or past the metadata's slot count), the combine told which requests
    the split kernel merged, PDL launches where asked; the shipped levers: the combine's PDL only."""
    inp = make_case([300, 70, 9000], 2, 16, torch.bfloat16, "cpu")
    meta, _ = op._metadata_torch(inp.cache_seqlens, 4)

    def plan(**levers):
        with configs.wgmma_levers(**levers):
            return op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "wgmma")

    call = plan(PDL=0)
    assert call.variant == "wgmma" and call.counters is None and call.combine_grid == (3, 32, 1)
    assert "launch_pdl" not in call.meta and "launch_pdl" not in call.combine_meta
    assert call.combine_meta["FUSED_SPLITS"] == 1 and not call.combine_meta["GDC"]
    call = plan()               # shipped: the combine as a programmatic dependent launch, nothing fused
    assert call.counters is None and call.combine_grid == (3, 32, 1) and "launch_pdl" not in call.meta
    assert call.combine_meta["launch_pdl"] and call.combine_meta["GDC"] and call.meta["PDL"] == 1
    call = plan(FUSED_SPLITS=8, PDL=1)
    assert call.counters == (3 * 8, torch.int32) and call.meta["MERGE_ROWS"] == 32
    assert call.combine_grid == (3, 32, 1) and call.combine_meta["FUSED_SPLITS"] == 8
    assert call.combine_meta["GDC"] and call.combine_meta["launch_pdl"] and "launch_pdl" not in call.meta
    call = plan(FUSED_SPLITS=meta.shape[0], PDL=2)
    assert call.combine_grid is None and call.meta["launch_pdl"]
    assert call.meta["FUSED_SPLITS"] == meta.shape[0]
    # the shipped levers again, and a name that is not a lever
    assert plan().meta == op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True,
                                             "wgmma").meta
    with pytest.raises(ValueError, match="levers"):
        with configs.wgmma_levers(FUSED=1):
            pass
    for other in (dict(Q_AHEAD=True), dict(FUSED_SPLITS=16), dict(PDL=2)):
        with pytest.raises(ValueError, match="SEESAW"):
            with configs.wgmma_levers(SEESAW=1, **other):
                pass
    assert plan(SEESAW=1).meta["SEESAW"] == 1 and plan().meta["SEESAW"] == 0
    # the combine's settings: its grid's third axis, its chunk (every kernel that leaves partials)
    with configs.wgmma_levers(COMBINE_S_CHUNK=32, COMBINE_COL_BLOCKS=4):
        call = op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "standard")
    assert call.combine_grid == (3, 32, 4) and call.combine_meta["S_CHUNK"] == 32
    assert call.combine_meta["COL_BLOCKS"] == 4 and configs.COMBINE == dict(S_CHUNK=None, COL_BLOCKS=None, ROWS=None)
    with configs.wgmma_levers(COMBINE_ROWS=4):        # 32 rows: 8 programs of 4 per request
        call = op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "wgmma")
    assert call.combine_grid == (3, 8, 1) and call.combine_meta["ROWS"] == 4 and plan().combine_meta["ROWS"] == 1
    for bad in (dict(COMBINE_COL_BLOCKS=3), dict(COMBINE_S_CHUNK=12), dict(COMBINE_ROWS=3), dict(COMBINE_SPLIT=2)):
        with pytest.raises(ValueError, match="COMBINE"):
            with configs.wgmma_levers(**bad):
                pass


def test_combine_settings_rule():
    """The combine's settings from shapes (configs.combine_settings): 32 partials per load where
    the schedule gives a request 12 or more parts, else 8; all 512 columns and one row per
    program; a lever pins any of them; the plan launches what it picks (the parts read back from
    the metadata's rows)."""
    rule = configs.combine_settings
    assert rule(1, 132) == (32, 1, 1) and rule(11, 132) == (32, 1, 1) and rule(3, 36) == (32, 1, 1)
    assert rule(12, 132) == (8, 1, 1) and rule(16, 66) == (8, 1, 1) and rule(128, 132) == (8, 1, 1)
    assert rule(3, 35) == (8, 1, 1)
    with configs.wgmma_levers(COMBINE_COL_BLOCKS=4, COMBINE_S_CHUNK=16, COMBINE_ROWS=8):
        assert rule(1, 132) == (16, 4, 8) and rule(128, 66) == (16, 4, 8)
    with configs.wgmma_levers(COMBINE_COL_BLOCKS=2):
        assert rule(1, 132) == (32, 2, 1) and rule(128, 66) == (8, 2, 1)
    assert rule(1, 132) == (32, 1, 1)
    inp = make_case([300, 70, 9000], 1, 16, torch.bfloat16, "cpu")
    for parts, want in ((36, 32), (35, 8), (4, 8)):
        meta, _ = op._metadata_torch(inp.cache_seqlens, parts)
        call = op._attention_call(inp.q, inp.k_cache, inp.block_table, meta, 576 ** -0.5, True, "wgmma")
        assert call.combine_meta["S_CHUNK"] == want and call.combine_meta["COL_BLOCKS"] == 1
        assert call.combine_grid == (3, 16, 1)


def test_wgmma_levers_replan_cached_calls(interpret):
    """A call planned before a lever changes is planned again inside and after the change (the
    plan cache's key holds ``configs.levers_version``)."""
    inp = make_case([70, 9], 1, 16, torch.float16, "cpu")
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1, num_sm_parts=2)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, meta, splits, None, True)
    first = op._plan_call(*args)
    assert op._plan_call(*args) is first
    with configs.wgmma_levers(PDL=1):
        inside = op._plan_call(*args)
        assert inside is not first
    assert op._plan_call(*args) is not inside


@pytest.mark.parametrize("s_chunk,col_blocks,per_program", [(8, 1, 1), (2, 4, 1), (4, 2, 1), (32, 1, 1), (8, 1, 2),
                                                           (2, 2, 4)])
def test_combine_leaves_fused_requests_to_the_split_kernel(interpret, s_chunk, col_blocks, per_program):
    """``mla_combine_kernel`` with FUSED_SPLITS = n merges only requests of more than n partials
    (the split kernel wrote the others): their outputs stay as they were. Each chunk of partials
    per load, split of the columns over programs and number of rows per program (the last
    program's rows past the 3: none written) (``configs.COMBINE``) merges the same."""
    from tilefuse.ops.mla import kernels

    rows, d = 3, 512
    num_splits = torch.tensor([0, 2, 7], dtype=torch.int32)          # request 0: 2 partials, request 1: 5
    o_acc = torch.randn(7 * rows, d)
    lse_acc = torch.randn(7 * rows)
    for fused, merged in ((1, [True, True]), (2, [False, True]), (5, [False, False])):
        out = torch.full((2, 1, rows, d), 7.0, dtype=torch.float16)
        lse = torch.full((2, rows, 1), 7.0)
        grid = (2, -(-rows // per_program), col_blocks)
        kernels.mla_combine_kernel[grid](num_splits, o_acc, lse_acc, out, lse, rows, rows, 7, rows * d, rows * d, d,
                                         rows, 1, S_CHUNK=s_chunk, SLOT_PROGRAMS=1, FUSED_SPLITS=fused, GDC=False,
                                         COL_BLOCKS=col_blocks, ROWS=per_program)
        for req, first, n in ((0, 0, 2), (1, 2, 5)):
            part = (first + torch.arange(n))[:, None] * rows + torch.arange(rows)[None, :]     # [n, rows]
            w = torch.softmax(lse_acc[part] * 0.6931471805599453, dim=0)
            want = (w[..., None] * o_acc[part]).sum(0)
            if merged[req]:
                assert_close(out[req, 0].float(), want, atol=2e-3, rtol=2e-3)
                assert_close(lse[req, :, 0], torch.logsumexp(lse_acc[part] * 0.6931471805599453, 0), atol=1e-5,
                             rtol=1e-5, name="lse")
            else:
                assert (out[req] == 7).all() and (lse[req] == 7).all()


@pytest.mark.parametrize("s_chunk,col_blocks,gdc,per_program", [(8, 1, False, 1), (8, 1, True, 1), (32, 1, True, 1),
                                                                 (32, 4, True, 1), (8, 1, True, 8)])
def test_mla_combine_compiles_for_sm90(s_chunk, col_blocks, gdc, per_program):
    """The combine launch compiles for sm_90a without spills in the settings its rule picks and
    the candidates, with the grid-dependency wait only where it is a programmatic dependent
    launch; at most 64 registers a thread where a load is at most 8 partials x 512 columns (the
    rule's pick for most batches); a load of 32 x 512 (128 values a thread, which the rule takes
    for few long requests only) takes 128 with Triton 3.6 and 167 with 3.9, so there only no
    spills; several rows per program (their unrolled chains overlap) up to 128 (72 at 8 rows)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from tilefuse.testing.gluon import compile_gluon_isolated

    pointers = {"num_splits_ptr": "*i32", "oacc_ptr": "*fp32", "lseacc_ptr": "*fp32", "out_ptr": "*bf16",
                "lse_ptr": "*fp32"}
    signature = {**pointers, **{n: "i32" for n in ("h_q", "rows_total", "num_slots", "stride_ob", "stride_os",
                                                   "stride_oh", "stride_lb", "stride_lh")}}
    constexprs = dict(S_CHUNK=s_chunk, SLOT_PROGRAMS=1, FUSED_SPLITS=1, GDC=gdc, COL_BLOCKS=col_blocks,
                      ROWS=per_program)
    signature.update({name: "constexpr" for name in constexprs})
    result = compile_gluon_isolated("tilefuse.ops.mla.kernels:mla_combine_kernel", signature, constexprs,
                                    num_warps=4, aligned=list(pointers))
    bound = 255 if s_chunk * 512 // col_blocks > 8192 else 64 if per_program == 1 else 128
    assert result.spilled == 0 and 0 < result.registers <= bound, result.ptxas
    assert ("griddepcontrol.wait" in result.ptx) == gdc


def test_combine_candidate_end_to_end(interpret):
    """The decode (tl kernels, several splits per request) with the combine's candidate settings
    (fewer columns per program, other chunks) against the fp64 reference."""
    inp = make_case([300, 1, 777, 0, 200], 1, 16, torch.float16, "cpu")
    with configs.wgmma_levers(COMBINE_S_CHUNK=2, COMBINE_COL_BLOCKS=4):
        out, lse = _run(inp, True, parts=8)
    _check(out, lse, inp, True)


def _need_gluon():
    if not op.wgmma_usable(torch.device("cuda")):
        pytest.skip("the Gluon kernel runs on Hopper")


@pytest.mark.gpu
@pytest.mark.parametrize("levers", list(LEVERS))
@pytest.mark.parametrize("h_q,s_q,page", [(16, 1, 64), (128, 2, 64), (24, 1, 16), (8, 4, 128), (1, 1, 32)])
def test_gpu_wgmma_levers(levers, h_q, s_q, page):
    """Each lever (and all at once) on lengths from 0 to 70000 (requests of 1 to many splits,
    both schedules' shapes), NaN past them, 1-256 query rows, pages of 16-128: the fp64 reference."""
    _need_gluon()
    lens = [0, 1, 63, 64, 65, 1000, 20000, 4097, 0, 333, 70000, 128]
    inp = make_case(lens, s_q, h_q, torch.bfloat16, "cuda", page_size=page)
    with configs.wgmma_levers(**LEVERS[levers]):
        out, lse = _run_gpu(inp, s_q, h_q, True, "wgmma")
        again = _run_gpu(inp, s_q, h_q, True, "wgmma")      # the counters were left at zero
    _check_gpu(out, lse, inp, True)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.gpu
@pytest.mark.parametrize("levers", ["fused16", "fusedall_pdl1", "every", "seesaw"])
def test_gpu_wgmma_levers_graph_replay_new_lengths(levers):
    """metadata + attention captured once with the levers on, replayed with lengths that change
    every request's split count (one long among short ones: the parts schedule, runs of splits;
    equal ones: the slots schedule; zeros), twice each: each replay against the fp64 reference
    and equal to an eager call (counters re-armed in the graph, nothing read from the host)."""
    _need_gluon()
    rng = torch.Generator().manual_seed(3)
    first = [70000] + torch.randint(1, 20000, (47,), generator=rng).tolist()
    inp = make_case(first, 1, 16, torch.bfloat16, "cuda", nan_tail=False)
    with configs.wgmma_levers(**LEVERS[levers]):
        def step():
            return _run_gpu(inp, 1, 16, True, "wgmma")

        graph, (g_out, g_lse) = captured(step)
        zipf = [max(1, int(20000 / (i + 1) ** 1.1)) for i in range(48)]
        for lens in (first, zipf, [0] * 24 + [4097] * 24, [3000] * 48):
            inp.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                _check_gpu(g_out, g_lse, inp, True)
            out, lse = step()
            assert torch.equal(out, g_out) and torch.equal(lse, g_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("levers", ["fused16", "fusedall_pdl1", "every", "seesaw"])
def test_gpu_wgmma_levers_two_streams_share_metadata(levers):
    """Two calls with one metadata on two streams at once (eager, then as two graphs replayed on
    two streams together) give what each gives alone: the fused combine's counters are per call
    (each stream's scratch, each captured call's own), never in the metadata."""
    _need_gluon()
    lens = [70000, 5, 3000, 129, 20000, 64, 1, 4097]
    a = make_case(lens, 1, 16, torch.bfloat16, "cuda", nan_tail=False)
    b = make_case(lens, 1, 16, torch.bfloat16, "cuda", nan_tail=False)
    with configs.wgmma_levers(**LEVERS[levers]):
        meta, splits = tilefuse.get_mla_metadata(a.cache_seqlens, 16, 1)

        def call(inp):
            return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)

        alone = [call(a), call(b)]
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for _ in range(3):
            outs = []
            for s, inp in zip(streams, (a, b)):
                with torch.cuda.stream(s):
                    outs.append(call(inp))
            torch.cuda.synchronize()
            for got, want in zip(outs, alone):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        graphs = []
        for inp in (a, b):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphs.append((graph, call(inp)))
        for _ in range(3):
            for s, (graph, _) in zip(streams, graphs):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    graph.replay()
            torch.cuda.synchronize()
            for (_, got), want in zip(graphs, alone):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check_gpu(*alone[0], a, True)
