"""Every op under concurrency and without host syncs, on the GPU.

* Stress: 4 streams driven by 2 threads launch every op with mixed shapes (two VQ layers with the
  same N and different K, SwiGLU split-K configs of different widths, MLA with the fused and the
  second-launch combine on one shared metadata, and a serving mix on the parts schedule), >= 10^4
  launches, then the same calls as
  CUDA-graph replays; every output is compared with the single-stream result, which is itself
  checked against the fp64 reference. Split-K state shared between launches made outputs wrong
  (and left the counters dirty for later calls) before scratch was made per stream / per captured
  call; the calls are re-run alone at the end to catch dirty state.
* No host sync: the default call path of every op and module runs under
  ``torch.cuda.set_sync_debug_mode("error")``.

Comparison: SwiGLU and MLA combine their partial sums in a fixed order (bit-identical across
runs); VQ adds its split-K partials with fp32 atomics in arrival order, so its outputs may differ
in the last fp32 bits, i.e. by at most one output ulp: ``rtol = 2^-7`` (bf16). A lost or doubled
partial sum is off by O(1) or inf.
"""

import random

import pytest
import torch

import tilefuse
from tilefuse.testing import assert_close, cos_diff, run_without_host_sync
from tilefuse.testing import mla as mla_cases
from tilefuse.testing import swiglu as swiglu_cases
from tilefuse.testing import vq as vq_cases
from tilefuse.testing.stress import run_threads

pytestmark = pytest.mark.gpu
DT = torch.bfloat16


def _calls():
    """name -> (zero-arg call returning one tensor, its fp64 reference or the family's check of an
    output against it (the VQ ops: their error bounds, ``tilefuse.testing.vq``), exact?)."""
    calls = {}
    for h, i in ((8192, 1024), (16384, 512)):          # split-K widths 2 and 4 (heuristic, M = 1)
        x, w, _ = swiglu_cases.make_case(1, h, i, DT, "cuda")
        calls[f"swiglu H{h} I{i}"] = (lambda x=x, w=w: tilefuse.swiglu(x, w), swiglu_cases.reference_fp64(x, w), True)
    for k in (4096, 14336):                             # same N, different K (K slices 8 and 28)
        c = vq_cases.make_case(1, 4096, k, DT, "cuda", bias=True)
        pick = tilefuse.explain(tilefuse.vq_matmul, *c.args()).variant
        calls[f"vq N4096 K{k}"] = (lambda c=c: tilefuse.vq_matmul(*c.args()),
                                   lambda out, c=c, pick=pick: vq_cases.check(out, c, pick), False)
    moe = vq_cases.make_moe_case(4, 8, 32, 2048, 768, DT, "cuda")      # 2-bit MoE experts: routing read on the device
    calls["vq_moe E32 top-8"] = (lambda c=moe: tilefuse.vq_moe(*c.args()),
                                 lambda out, c=moe: vq_cases.check_moe(out, c), True)
    for h_q in (16, 128):                               # second-launch combine / fused combine
        inp = mla_cases.make_case([3000, 70, 0, 9000], 1, h_q, DT, "cuda")
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, h_q, 1)
        ref = mla_cases.reference_fp64(inp, causal=True)[0]
        calls[f"mla h{h_q}"] = (lambda inp=inp, meta=meta, splits=splits: tilefuse.flash_mla_with_kvcache(
            *inp.args(), 512, meta, splits, causal=True)[0], ref, True)
    for h_q in (16, 128):                               # the FP8 cache: 32-row tiles / 64-row tiles
        inp = mla_cases.make_case([3000, 70, 0, 9000], 1, h_q, DT, "cuda", nan_tail=False)
        packed = tilefuse.mla_quantize_kv(inp.k_cache)
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, h_q, 1)
        inp.k_cache = tilefuse.mla_dequantize_kv(packed, DT)     # the reference's cache: the dequantized values
        fp8_args = (inp.q, packed, inp.block_table, inp.cache_seqlens, 512, meta, splits)
        calls[f"mla fp8 h{h_q}"] = (lambda a=fp8_args: tilefuse.flash_mla_with_kvcache(
            *a, causal=True, is_fp8_kvcache=True)[0], mla_cases.reference_fp64(inp, causal=True)[0], True)
    # a serving mix the metadata gives the parts schedule on a 132-SM Hopper (one 70000-token
    # request among 95 of 1-20000): each Gluon program runs a run of splits
    lens = [70000] + torch.randint(1, 20000, (95,), generator=torch.Generator().manual_seed(0)).tolist()
    inp = mla_cases.make_case(lens, 1, 16, DT, "cuda")
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1)
    calls["mla h16 serving mix"] = (lambda inp=inp, meta=meta, splits=splits: tilefuse.flash_mla_with_kvcache(
        *inp.args(), 512, meta, splits, causal=True)[0], mla_cases.reference_fp64(inp, causal=True)[0], True)
    return calls


def _matches(out, expected, exact):
    return torch.equal(out, expected) if exact else torch.allclose(out, expected, rtol=2 ** -7, atol=1e-3)


@pytest.fixture(scope="module")
def calls():
    calls = _calls()
    expected = {}
    for name, (fn, ref, _) in calls.items():
        out = fn()
        if callable(ref):
            ref(out)
        elif name.startswith("mla"):
            assert cos_diff(out, ref) < 1e-5, name
        else:
            assert_close(out, ref, atol=1e-2, rtol=2 ** -7, name=name)
        expected[name] = out.clone()
    torch.cuda.synchronize()
    return calls, expected


def _rerun_alone(calls, expected):
    for name, (fn, _, exact) in calls.items():
        assert _matches(fn(), expected[name], exact), f"{name}: wrong when run alone afterwards (dirty state)"


def test_streams_and_threads_eager(calls):
    calls, expected = calls
    names = list(calls)
    rounds = 420                                  # 2 threads x 2 streams x 10 calls x 420 = 16800 launches
    mismatches = []

    def work(index):
        rng = random.Random(index)
        streams = [torch.cuda.Stream() for _ in range(2)]
        for _ in range(rounds):
            outs = []
            for stream in streams:
                with torch.cuda.stream(stream):
                    for name in rng.sample(names, len(names)):
                        outs.append((name, calls[name][0]()))
            for stream in streams:
                stream.synchronize()
            mismatches.extend(name for name, out in outs if not _matches(out, expected[name], calls[name][2]))

    run_threads(work)
    assert not mismatches, f"{len(mismatches)} wrong outputs of {2 * 2 * len(names) * rounds}: {sorted(set(mismatches))}"
    _rerun_alone(calls, expected)


def test_streams_and_threads_graph_replay(calls):
    calls, expected = calls
    names = list(calls)
    graphs = []
    rng = random.Random(7)
    for _ in range(4):                            # captured one after the other, replayed concurrently
        order = [rng.choice(names) for _ in range(10)]
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [(name, calls[name][0]()) for name in order]
        graphs.append((graph, stream, outs))
    replays = 250                                 # 4 graphs x 10 calls x 250 = 10^4 launches
    mismatches = []

    def work(index):
        for graph, stream, outs in graphs[2 * index: 2 * index + 2]:
            for _ in range(replays):
                with torch.cuda.stream(stream):
                    graph.replay()
                stream.synchronize()
                mismatches.extend(name for name, out in outs if not _matches(out, expected[name], calls[name][2]))

    run_threads(work)
    assert not mismatches, f"{len(mismatches)} wrong outputs of {4 * 10 * replays}: {sorted(set(mismatches))}"
    _rerun_alone(calls, expected)


def test_default_paths_never_sync_with_the_host():
    """Every op and module on its default path, after warm-up, under sync debug mode "error"."""
    from tilefuse.nn import FusedSwiGLUMLP, MLADecodeAttention, VQLinear

    x1, w, _ = swiglu_cases.make_case(1, 896, 4864, DT, "cuda")
    x4k = torch.randn(4096, 896, dtype=DT, device="cuda")
    mlp = FusedSwiGLUMLP(896, 4864, dtype=DT, device="cuda")
    c = vq_cases.make_case(16, 4096, 4096, DT, "cuda", bias=True)
    layer = VQLinear(4096, 4096, dtype=DT, device="cuda").load_quantized(c.codes, c.codebooks, c.scales,
                                                                          c.bias)
    inp = mla_cases.make_case([3000, 70], 1, 16, DT, "cuda")
    inp128 = mla_cases.make_case([3000, 70], 1, 128, DT, "cuda")
    attn = MLADecodeAttention(16)
    fp8 = [swiglu_cases.make_fp8_case(m, 896, 4864, "cuda", x_scaling=xs, w_scaling=ws)
           for m, xs, ws in ((1, "group", "block"), (256, "token", "channel"))]

    def step():
        tilefuse.swiglu(x1, w)
        tilefuse.swiglu(x4k, w)
        mlp(x1)
        for f in fp8:
            tilefuse.swiglu_fp8(*f.args())
            tilefuse.swiglu_fp8(*f.args(), out_dtype=torch.float8_e4m3fn)
        for m in (1, 4, 16):
            tilefuse.vq_matmul(c.x[:m], c.codes, c.codebooks, c.scales, c.bias)
            layer(c.x[:m])
        for i in (inp, inp128):
            meta, splits = tilefuse.get_mla_metadata(i.cache_seqlens, i.q.shape[2], 1)
            tilefuse.flash_mla_with_kvcache(*i.args(), 512, meta, splits, causal=True)
        attn.plan(inp.cache_seqlens)
        attn(inp.q, inp.k_cache, inp.block_table)

    step()
    run_without_host_sync(step)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- cuBLAS under capture
# Graphs captured by ``torch.cuda.graph`` without a ``stream`` share one capture stream, and PyTorch
# keeps one cuBLAS workspace per (handle, stream): before ``_scratch.blas`` two such graphs held
# the same workspace, and replaying them at once on two streams let their split-K GEMMs overwrite
# each other's partials (an H100 gave 73 and 37 wrong outputs of 800 at the shapes below, on the
# unfused path the dispatch picks there). Every tilefuse path that runs cuBLAS is checked: the
# default pick, a pinned unfused swiglu, the FP8 pipeline's ``torch._scaled_mm``, the fp32 reference
# (cuBLAS GEMMs), FusedSwiGLUMLP (its down projection) and VQ's dequantize + cuBLAS path.
BLAS_SHAPES = ((8192, 1024), (16384, 512))       # M = 4: split-K GEMMs in cuBLAS


def blas_paths():
    """name -> builder(h, i) -> zero-arg call; every tilefuse path that runs a cuBLAS GEMM at M = 4."""
    from tilefuse.nn import FusedSwiGLUMLP

    def swiglu(dtype, variant=None):
        def build(h, i):
            x, w, _ = swiglu_cases.make_case(4, h, i, dtype, "cuda")
            if variant is None:
                return lambda: tilefuse.swiglu(x, w)

            def call():
                with tilefuse.force(variant=variant):
                    return tilefuse.swiglu(x, w)
            return call
        return build

    def fp8(h, i):
        c = swiglu_cases.make_fp8_case(4, h, i, "cuda", x_scaling="token", w_scaling="channel")

        def call():
            with tilefuse.force(variant="unfused", family="swiglu_fp8"):
                return tilefuse.swiglu_fp8(*c.args())
        return call

    def mlp(h, i):
        module = FusedSwiGLUMLP(h, i, dtype=DT, device="cuda")
        x = torch.randn(4, h, dtype=DT, device="cuda")

        def call():
            with torch.no_grad():
                return module(x)
        return call

    def vq_dequant(h, i):                         # dequantize + cuBLAS: the VQ path that runs a GEMM
        case = vq_cases.make_case(4, i, h, torch.float16, "cuda")

        def call():
            with tilefuse.force(variant="dequant", family="vq"):
                return tilefuse.vq_matmul(*case.args())
        return call

    def plain_linear(h, i):                       # PyTorch alone: shows the harness catches the race
        x, w, _ = swiglu_cases.make_case(4, h, i, DT, "cuda")
        return lambda: torch.nn.functional.linear(x, w)

    return {"swiglu default": swiglu(DT), "swiglu unfused pinned": swiglu(DT, "unfused"),
            "swiglu_fp8 unfused pinned": fp8, "swiglu fp32 reference": swiglu(torch.float32),
            "FusedSwiGLUMLP": mlp, "vq dequant pinned": vq_dequant, "plain F.linear": plain_linear}


def graph_race(build, pair, replays=400, rel=1e-2):
    """Capture one graph per shape of ``pair`` with ``torch.cuda.graph`` on its shared default
    capture stream, replay both at once on two streams ``replays`` times and count the outputs
    off by more than ``rel`` (max abs error / max abs of the call's eager result): (wrong, total).
    The count is kept on the GPU (no sync per replay)."""
    fns = [build(h, i) for h, i in pair]
    expected = [fn().float() for fn in fns]                 # eager, alone: warm-up and the answer
    assert all(torch.isfinite(e).all() and e.abs().max() > 0 for e in expected)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn())
        graphs.append(graph)
    streams = [torch.cuda.Stream() for _ in fns]
    wrong = [torch.zeros((), dtype=torch.int64, device="cuda") for _ in fns]
    torch.cuda.synchronize()
    for _ in range(replays):
        for graph, stream, out, exp, bad in zip(graphs, streams, outs, expected, wrong):
            with torch.cuda.stream(stream):
                graph.replay()
                bad += ((out.float() - exp).abs().max() > rel * exp.abs().max()).long()
    torch.cuda.synchronize()
    return sum(int(b) for b in wrong), replays * len(fns)


@pytest.mark.parametrize("pair", [BLAS_SHAPES, BLAS_SHAPES[1:] * 2], ids=["two shapes", "one shape twice"])
@pytest.mark.parametrize("path", ["swiglu default", "swiglu unfused pinned", "swiglu_fp8 unfused pinned",
                                  "swiglu fp32 reference", "FusedSwiGLUMLP", "vq dequant pinned"])
def test_graphs_on_the_shared_capture_stream_replayed_at_once(path, pair):
    wrong, total = graph_race(blas_paths()[path], pair)
    assert wrong == 0, f"{path}: {wrong} of {total} outputs wrong"
