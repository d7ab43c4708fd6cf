"""``tilefuse bench tp``: tensor-parallel decode at TP=1 and TP=N, launched by ``torchrun``.

    torchrun --nproc-per-node 2 -m tilefuse bench tp [--quick] [--out DIR]

Every rank measures TP=1 on its own GPU at the same time (the one-device modules, no collective),
then all ranks measure TP=N together (``tilefuse.parallel`` shards, NCCL). Without ``torchrun``
only TP=1 runs; without a GPU, gloo processes run the reference path on toy shapes once each: a
pipeline check (outputs against TP=1, token agreement), nothing timed.

Per-layer cases (bf16, one decode step, weights built from one seed on every rank; the layers are
in :mod:`tilefuse.bench.tp_layers`):

* ``mlp`` -- Llama-3-8B (H 4096, I 14336) and 70B (8192, 28672) SwiGLU MLPs at M = 1, 4, 16 tokens:
  ``FusedSwiGLUMLP`` at TP=1, :class:`~tilefuse.parallel.ParallelSwiGLUMLP` at TP=N;
* ``mlp-vq2`` -- the 70B MLP in 2-bit 2x8 VQ (gate/up column-, down row-parallel ``VQLinear``) at M = 1, 4;
* ``mla`` -- a DeepSeek-V3 MLA decode layer (hidden 7168, q latent 1536, 128 or 32 heads, 576/512
  latent, v head 128), batch 16, 16K and 64K context: q up-projection (column-parallel over the
  heads), W_UK absorption, paged attention on the rank's heads
  (:class:`~tilefuse.parallel.ParallelMLADecodeAttention`, replicated latent cache), W_UV, output
  projection (row-parallel, the all-reduce).

Implementations per case: ``layer`` (the whole layer, its all-reduce included), ``local`` (TP=N
only: the layer without its all-reduce, the rank's compute), ``allreduce`` (TP=N: the all-reduce
of the layer's output alone), ``attention`` (MLA: the attention call alone). Times as the other
benchmarks (``gpu_us`` per eager call with cold L2, ``graph_us`` CUDA-graph replay with cold L2,
``eager_us`` wall clock of back-to-back calls) with two changes that collectives need: every rank
runs the same fixed number of calls (no per-rank calibration, which could leave a rank waiting in
an all-reduce forever), and each timed call starts right after a one-element all-reduce, so the
ranks start together and a call's time is not another rank's lateness. A row's times are the
slowest rank's (a step waits for it); ``rank_graph_us`` lists all.

End to end (``e2e``, :mod:`tilefuse.bench.tp_e2e`): greedy decoding of a Llama-3-8B-shaped model
(random weights, ``--layers`` blocks, 4 with ``--quick``), ms per token with a CUDA-graph decode
step and eagerly, batch 1 and 16: stock and fused (``tilefuse.hf.patch_swiglu``) at TP=1; at TP=N through
:func:`tilefuse.parallel.shard_model` (dense and fused) and, where ``accelerate`` is installed,
transformers' own ``tp_plan="auto"`` (stock, and with :func:`tilefuse.parallel.hf.patch_swiglu`).

DeepSeek (``deepseek-decode``, :mod:`tilefuse.bench.tp_deepseek`; ``--only deepseek-decode`` runs it
alone): greedy decoding of a DeepSeek-V3-shaped model (8 dense blocks, 128 heads) through
``patch_mla`` at TP=1 and every power of two up to N, batch 16 after a 32K-token context, graph
and eager, tilefuse's attention and FlashMLA's where built.

Results: ``<out>/tp-<gpu>x<N>[-quick][-<tag>].json`` (rows, summary with the TP=N / TP=1 ratios
and goals, machine with every rank's GPU, NCCL version). Goals: 70B MLP at M 1-16 and the
128-head MLA layer at >= 16K context, TP=N layer time over TP=1 <= 0.6 and <= 0.55 (graph and
eager judged apart); TP=N outputs within the tolerance of :mod:`tilefuse.testing.parallel`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tilefuse._launch import capture_graph as capture  # noqa: F401  (the tests capture as the bench does)
from tilefuse.bench.harness import check, geomean, ratio, tally
from tilefuse.bench.tp_common import Plan, gather_rows, log  # noqa: F401  (shared with tp_e2e)
from tilefuse.bench.tp_layers import MLA_DIMS, mla_layer, mlp_layer, shard_vq_mlp, vq_mlp

MLP_SHAPES = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}
FLUSH_BYTES = 256 << 20


GPU_PLAN = Plan((1, 4, 16), (1, 4), (128, 32), (16384, 65536), 16, 10, 100, 20.0, 8, (1, 16), 128, 48)
GPU_QUICK_PLAN = Plan((1, 4, 16), (1, 4), (128, 32), (16384, 65536), 16, 5, 40, 10.0, 4, (1, 16), 64, 24)
CPU_PLAN = Plan((1, 4), (1,), (8,), (256,), 2, 1, 3, 2.0, 2, (1,), 8, 6)


# ----------------------------------------------------------------------------- timing
class TPTimer:
    """Times zero-arg callables the same number of times on every rank of ``group`` (None: this
    rank alone). See the module docstring for the three times."""

    def __init__(self, device: torch.device, group, plan: Plan):
        self.device, self.group, self.plan = device, group, plan
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES if self.cuda else 1, dtype=torch.int8, device=device)
        self.token = torch.zeros(1, device=device)

    def _align(self) -> None:
        if self.group is not None:
            dist.all_reduce(self.token, group=self.group)

    def agree_max(self, value: float) -> float:
        """The largest ``value`` over the ranks of the group."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def _per_call_us(self, fn: Callable[[], object]) -> float:
        """Median of single calls, each after an L2 flush and an aligning all-reduce (GPU)."""
        for _ in range(self.plan.warmup):
            fn()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(self.plan.reps)]
        for start, end in pairs:
            self.flush.zero_()
            self._align()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in pairs)

    def eager_us(self, fn: Callable[[], object], calls: int) -> float:
        """Wall clock per call of ``calls`` back-to-back calls, one synchronize at the end; median of 3."""
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        fn()
        samples = []
        for _ in range(3):
            sync()
            self._align()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(samples) / calls

    def times(self, fn: Callable[[], object]) -> dict:
        """gpu_us, graph_us and eager_us of this rank; the same call counts on every rank. On a CPU
        ``fn`` runs once and nothing is timed (``{}``)."""
        if not self.cuda:
            fn()
            return {}
        out: dict = {"gpu_us": self._per_call_us(fn)}
        try:
            graph, _ = capture(fn)
            out["graph_us"] = self._per_call_us(graph.replay)
            del graph
        except RuntimeError as exc:
            out["graph_us"], out["graph_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
        guess = self.agree_max(out["gpu_us"])
        calls = int(min(2000, max(5, self.plan.eager_ms * 1e3 / max(guess, 1.0))))
        out["eager_us"], out["eager_calls"] = self.eager_us(fn, calls), calls
        return out


def merge(per_rank: list[dict]) -> dict:
    """One row's times from all ranks': the slowest rank's, plus each rank's graph/eager time."""
    row = dict(per_rank[0])
    for key in ("gpu_us", "graph_us", "eager_us"):
        values = [r.get(key) for r in per_rank]
        if all(v is not None for v in values):
            row[key] = max(values)
            row[f"rank_{key}"] = [round(v, 2) for v in values]
    return row


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One per-layer case: ``build(group, reduce)`` makes the layer (group None: TP=1) and
    ``inputs()`` its call arguments; ``out_shape`` the output (for the all-reduce alone)."""

    kind: str
    params: dict
    build: Callable
    inputs: Callable
    scale: Callable | None = None     # (layer, args) -> |.| @ |W|^T of the output, for the tolerance
    tolerance_kind: str = "mlp"


def mlp_cases(plan: Plan, dtype, device, cpu: bool) -> list[Case]:
    from tilefuse.parallel import shard

    shapes = {"toy": (64, 256)} if cpu else MLP_SHAPES
    out = []
    for model, (hidden, inter) in shapes.items():
        for m in plan.mlp_tokens:
            def build(group, reduce, hidden=hidden, inter=inter):
                full = mlp_layer(hidden, inter, dtype, device)
                return full if group is None else shard(full, group, reduce_results=reduce)

            def inputs(m=m, hidden=hidden):
                gen = torch.Generator(device=device).manual_seed(1)
                return (torch.randn(m, hidden, generator=gen, device=device).to(dtype),)

            out.append(Case("mlp", {"model": model, "H": hidden, "I": inter, "M": m}, build, inputs, _mlp_scale))
    hidden, inter = (64, 256) if cpu else MLP_SHAPES["llama3-70b"]
    for m in plan.vq_tokens:
        def build_vq(group, reduce, hidden=hidden, inter=inter):
            full = vq_mlp(hidden, inter, dtype, device)
            return full if group is None else shard_vq_mlp(full, group, reduce)

        def inputs_vq(m=m, hidden=hidden):
            gen = torch.Generator(device=device).manual_seed(1)
            return (torch.randn(m, hidden, generator=gen, device=device).to(dtype),)

        out.append(Case("mlp-vq2", {"model": "llama3-70b" if not cpu else "toy", "H": hidden, "I": inter, "M": m},
                        build_vq, inputs_vq, _vq_scale, "unfused-mlp"))
    return out


def _mlp_scale(layer, args):
    from tilefuse.ops.swiglu.reference import swiglu_reference
    from tilefuse.testing.parallel import error_scale

    (x,) = args
    h = swiglu_reference(x.double(), layer.gate_up_weight.double(), compute_dtype=torch.float64)
    return error_scale(h, layer.down_proj.weight)


def _vq_scale(layer, args):
    from tilefuse.testing.parallel import error_scale

    (x,) = args
    h = F.silu(layer.gate(x.double())) * layer.up(x.double())
    return error_scale(h, layer.down.dequantize())


_MLA_CACHE: dict = {}


def mla_cases(plan: Plan, dtype, device, cpu: bool) -> list[Case]:
    from tilefuse.testing.mla import paged_cache

    out = []
    for ctx in plan.mla_contexts:
        for heads in plan.mla_heads:
            def build(group, reduce, heads=heads):
                full = mla_layer(heads, dtype, device)
                return full if group is None else full.shard(group, reduce)

            def inputs(ctx=ctx):
                key = (ctx, plan.mla_batch)
                if key not in _MLA_CACHE:
                    _MLA_CACHE.clear()
                    torch.manual_seed(3)     # the same cache and block table on every rank
                    k_cache, table = paged_cache([ctx] * plan.mla_batch, dtype, device, nan_tail=False)
                    lens = torch.full((plan.mla_batch,), ctx, dtype=torch.int32, device=device)
                    gen = torch.Generator(device=device).manual_seed(1)
                    c_q = torch.randn(plan.mla_batch, MLA_DIMS["q_rank"], generator=gen, device=device).to(dtype)
                    _MLA_CACHE[key] = (c_q, k_cache, table, lens)
                return _MLA_CACHE[key]

            out.append(Case("mla", {"model": "deepseek-v3", "heads": heads, "batch": plan.mla_batch, "context": ctx},
                            build, inputs, None, "mla"))
    return out


def run_case(case: Case, tp: int, group, timer: TPTimer, reference: dict) -> list[dict]:
    """The case's rows at TP=tp on this rank (group None: TP=1, this rank alone)."""
    from tilefuse.parallel import placement
    from tilefuse.testing.compare import cos_diff
    from tilefuse.testing.parallel import check_within, tp_tolerance

    args = case.inputs()
    layer = case.build(group, True)
    if case.kind == "mla":      # c_q, cache, block table; the lengths plan the attention once per step
        lens, args = args[3], args[:3]
        layer.attn.plan(lens)
        q = torch.randn(args[0].shape[0], 1, layer.w_uk.shape[0], 576, device=args[0].device, dtype=args[0].dtype)
    impls: dict[str, Callable[[], object]] = {"layer": lambda: layer(*args)}
    if case.kind == "mla":
        impls["attention"] = lambda: layer.attn(q, *args[1:3])
    with torch.no_grad():
        out = layer(*args)
    rows = []
    extra: dict = {}
    if tp == 1:
        reference[case_key(case)] = out.clone()
        if case.scale is not None:
            with torch.no_grad():
                reference[case_key(case) + ("scale",)] = case.scale(layer, args)
    else:
        want = reference.get(case_key(case))
        if want is not None:
            extra["cos_diff_vs_tp1"] = cos_diff(out, want)
            extra["max_rel_diff_vs_tp1"] = float((out.double() - want.double()).abs().max() / want.double().abs().max())
            scale = reference.get(case_key(case) + ("scale",))
            if scale is not None:
                factor = tp_tolerance(out.dtype, case.tolerance_kind)
                try:
                    extra["worst_over_tolerance"] = check_within(out, want, scale, factor)
                except AssertionError as exc:
                    extra["worst_over_tolerance"], extra["tolerance_error"] = float("inf"), str(exc)[:300]
        local = case.build(group, False)
        if case.kind == "mla":
            local.attn.plan(lens)
        impls["local"] = lambda: local(*args)
        reduced = torch.zeros_like(out)
        where = placement(group)
        impls["allreduce"] = lambda: dist.all_reduce(reduced, group=where.group)
    for impl, fn in impls.items():
        with torch.no_grad():
            times = timer.times(fn)
        rows.append({"family": "tp", "kind": case.kind, "tp": tp, "impl": impl, "params": dict(case.params),
                     **times, **(extra if impl == "layer" else {})})
    if case.kind == "mla":
        c_q = args[0]       # the kernel follows the queries' device and dtype (c_q's)
        rows[0]["kernel"] = (layer.attn.kernel(1, args[2].shape[1], c_q.device, c_q.dtype) if tp > 1
                             else _kernel(layer.attn, args[2], c_q))
    return rows


def _kernel(attn, block_table, q) -> str:
    from tilefuse.ops.mla.op import choose_variant

    return choose_variant(attn.num_heads, block_table.shape[1], q)


def case_key(case: Case) -> tuple:
    return (case.kind, *sorted(case.params.items()))


# ----------------------------------------------------------------------------- summary
MLP_GOAL, MLA_GOAL = 0.6, 0.55


def summarize(rows: list[dict], world: int) -> dict:
    """TP=world / TP=1 layer-time ratios per case (gpu, graph, eager), the all-reduce's share, the
    accuracy against TP=1, and the goals."""
    table: dict = {}
    for row in rows:
        if row["kind"] not in ("e2e", "deepseek-decode"):
            table.setdefault((row["kind"], json.dumps(row["params"], sort_keys=True)), {})[(row["tp"], row["impl"])] = row
    cases, goals = [], {"mlp": [], "mla": []}
    for (kind, params), impls in table.items():
        one, many = impls.get((1, "layer"), {}), impls.get((world, "layer"), {}) if world > 1 else {}
        reduce = impls.get((world, "allreduce"), {})
        entry = {"kind": kind, "params": json.loads(params)}
        for mode in ("gpu_us", "graph_us", "eager_us"):
            entry[f"tp1_{mode}"], entry[f"tp{world}_{mode}"] = one.get(mode), many.get(mode)
            entry[f"ratio_{mode.removesuffix('_us')}"] = ratio(many.get(mode), one.get(mode))
            entry[f"allreduce_{mode}"] = reduce.get(mode)
            entry[f"local_{mode}"] = impls.get((world, "local"), {}).get(mode)
        for key in ("worst_over_tolerance", "cos_diff_vs_tp1", "max_rel_diff_vs_tp1"):
            entry[key] = many.get(key)
        if kind == "mla":
            entry["kernel_tp1"], entry[f"kernel_tp{world}"] = one.get("kernel"), many.get("kernel")
            entry["attention_ratio_graph"] = ratio(impls.get((world, "attention"), {}).get("graph_us"),
                                                   impls.get((1, "attention"), {}).get("graph_us"))
        p = entry["params"]
        if kind == "mlp" and p["model"] == "llama3-70b" and p["M"] <= 16:
            goals["mlp"].append(entry)
        if kind == "mla" and p["heads"] == 128 and p["context"] >= 16384:
            goals["mla"].append(entry)
        cases.append(entry)
    judged = []
    for name, bound, entries in (("70B MLP, M 1-16", MLP_GOAL, goals["mlp"]),
                                 ("MLA 128 heads, >= 16K context", MLA_GOAL, goals["mla"])):
        for mode in ("graph", "eager"):
            judged.append(tally(f"{name}: TP={world} / TP=1 layer {mode} time <= {bound}",
                                [check(name, e[f"ratio_{mode}"], "<=", bound) for e in entries]))
    acc = [c["worst_over_tolerance"] for c in cases if c.get("worst_over_tolerance") is not None]
    judged.append(check(f"TP={world} outputs within the TP=1 tolerance (worst |diff| / tolerance)",
                        max(acc) if acc else None, "<=", 1.0))
    cos = [c["cos_diff_vs_tp1"] for c in cases if c.get("cos_diff_vs_tp1") is not None]
    judged.append(check(f"every layer: TP={world} vs TP=1 cos_diff x 1e6", 1e6 * max(cos) if cos else None, "<=", 10))
    e2e = [r for r in rows if r["kind"] == "e2e"]
    return {"cases": cases, "goals": judged, "e2e": _e2e_table(e2e),
            "geomean_ratio_graph": geomean(c["ratio_graph"] for c in cases if c.get("ratio_graph"))}


def _e2e_table(rows: list[dict]) -> list[dict]:
    """Each e2e row that ran, with its speedup over TP=1 stock (stock's ms/token over its own, same
    batch and mode; None where not timed)."""
    rows = [r for r in rows if "error" not in r]
    base = {(r["params"]["batch"], r["mode"]): r.get("ms_per_token") for r in rows if r["impl"] == "stock"}
    return [{"impl": r["impl"], "tp": r["tp"], "batch": r["params"]["batch"], "mode": r["mode"],
             "ms_per_token": r.get("ms_per_token"),
             "speedup_over_tp1_stock": ratio(base.get((r["params"]["batch"], r["mode"])), r.get("ms_per_token")),
             "agreement_vs_tp1_stock": r["agreement_vs_tp1_stock"]} for r in rows]


def print_summary(summary: dict, world: int, file=None) -> None:
    file = file or sys.stdout
    print("", file=file)
    if summary["cases"]:
        print(f"tp: graph, eager = time ratio, layer time at TP={world} / at TP=1 (slowest rank; < 1: TP={world} "
              f"faster); AR = the all-reduce alone at TP={world}", file=file)
        print(f"{'case':<44} {'graph':>6} {'eager':>6} {'tp1 us':>8} {'tp' + str(world) + ' us':>8} {'AR us':>7} "
              f"{'tol':>5}", file=file)
    fmt = lambda v, s=".2f": "-" if v is None else format(v, s)  # noqa: E731
    for c in summary["cases"]:
        label = f"{c['kind']} " + " ".join(f"{k}={v}" for k, v in c["params"].items())
        print(f"{label:<44} {fmt(c['ratio_graph']):>6} {fmt(c['ratio_eager']):>6} {fmt(c['tp1_graph_us'], '.1f'):>8} "
              f"{fmt(c[f'tp{world}_graph_us'], '.1f'):>8} {fmt(c['allreduce_graph_us'], '.1f'):>7} "
              f"{fmt(c.get('worst_over_tolerance')):>5}", file=file)
    if summary["e2e"]:
        print("e2e: x TP=1 stock = speedup = TP=1 stock ms/token / this ms/token (> 1: faster)", file=file)
    for e in summary["e2e"]:
        print(f"e2e {e['impl']:<34} tp={e['tp']} b={e['batch']:<3} {e['mode']:<5} {fmt(e['ms_per_token'], '.3f')} "
              f"ms/token, {fmt(e['speedup_over_tp1_stock'])}x TP=1 stock, agreement {e['agreement_vs_tp1_stock']}",
              file=file)
    if summary.get("deepseek"):
        from tilefuse.bench.tp_deepseek import print_deepseek

        print_deepseek(summary["deepseek"], file)
    for goal in summary["goals"]:
        state = {True: "ok", False: "FAIL", None: "not measured"}[goal["met"]]
        measured = f"met in {goal['met_in']}/{goal['of']}" if "met_in" in goal else f"{goal['measured']}"
        print(f"  [{state}] {goal['goal']}: {measured}", file=file)


# ----------------------------------------------------------------------------- entry point
def machine(device: torch.device, world: int) -> dict:
    from tilefuse.bench.runner import machine_info

    info = machine_info(device)
    info["world_size"] = world
    info["gpus"] = gather_rows({"gpu": info["gpu"]}, world)
    if device.type == "cuda":
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    info["launcher"] = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else "python"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def ceilings(device: torch.device, world: int) -> dict:
    """This GPU's copy bandwidth and bf16 GEMM rate (the one-device roofline), and the bus bandwidth
    of a 256 MiB bf16 all-reduce over the ranks (NCCL's busbw = algbw * 2 (n - 1) / n)."""
    from tilefuse.bench.harness import measure_ceilings

    if device.type != "cuda":
        return {}
    one = measure_ceilings(device, quick=True)
    out = {"copy_gbps": one.copy_gbps, "gemm_bf16_tflops": one.gemm_bf16_tflops}
    if world > 1:
        buf = torch.zeros(128 << 20, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dist.all_reduce(buf)
        end.record()
        torch.cuda.synchronize()
        algbw = 10 * buf.numel() * 2 / (start.elapsed_time(end) * 1e-3) / 1e9
        out["allreduce_busbw_gbps"] = algbw * 2 * (world - 1) / world
        del buf
    return out


def result_path(out_dir: Path, gpu: str, world: int, quick: bool, tag: str | None) -> Path:
    from tilefuse.bench.runner import _slug

    suffix = ("-quick" if quick else "") + (f"-{_slug(tag)}" if tag else "")
    return out_dir / f"tp-{_slug(gpu)}x{world}{suffix}.json"


def run(quick: bool = False, out_dir: Path = Path("bench/results"), only: str | None = None, tag: str | None = None,
        layers: int | None = None) -> int:
    """The benchmark on this rank of an initialized group (or alone); rank 0 writes the results.
    Returns 2 when ``only`` matches nothing; 1 when a CPU pipeline check failed; else 0."""
    if layers is not None and (not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers: expected a positive number of blocks, got {layers!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    plan = GPU_QUICK_PLAN if quick and cuda else GPU_PLAN if cuda else CPU_PLAN
    if layers:
        plan = Plan(**{**plan.__dict__, "e2e_layers": layers})
    dtype = torch.bfloat16 if cuda else torch.float32
    tag = tag or ("only" if only else None)
    cases = mlp_cases(plan, dtype, device, not cuda) + mla_cases(plan, dtype, device, not cuda)
    if only:
        cases = [c for c in cases if only in json.dumps({"kind": c.kind, **c.params})]
    run_e2e = not only or only in "e2e"
    run_deepseek = not only or only in "deepseek-decode"
    if not cases and not run_e2e and not run_deepseek:
        log(f"--only {only!r}: no tp case matches")
        return 2
    if world == 1:
        log("one process: TP=1 only (launch with torchrun --nproc-per-node 2 for TP=2)")
    head = {"machine": machine(device, world), "ceilings": ceilings(device, world), "timing": {
        "mode": "gpu" if cuda else "cpu-pipeline-check", "note": __doc__.split("Implementations per case:")[1].split(
            "End to end")[0].strip(), "warmup": plan.warmup, "reps": plan.reps, "eager_ms": plan.eager_ms}}
    path = result_path(out_dir, head["machine"]["gpu"], world, quick, tag)
    rows: list[dict] = []

    def save(summary: dict | None = None) -> None:
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            payload = {**head, "rows": rows, **({"summary": summary} if summary else {"incomplete": True})}
            path.write_text(json.dumps(payload, indent=1, default=str) + "\n")

    timers = {1: TPTimer(device, None, plan)}
    if world > 1:
        timers[world] = TPTimer(device, dist.group.WORLD, plan)
    reference: dict = {}
    for i, case in enumerate(cases, 1):
        log(f"[{i}/{len(cases)}] {case.kind} {case.params}")
        for tp, timer in timers.items():
            local = run_case(case, tp, None if tp == 1 else dist.group.WORLD, timer, reference)
            per_rank = [gather_rows(r, world) for r in local]
            rows.extend(merge(parts) for parts in per_rank)
        reference.clear()
        if cuda:
            torch.cuda.empty_cache()
        save()
    _MLA_CACHE.clear()
    if run_e2e:
        from tilefuse.bench.tp_e2e import e2e_rows

        rows.extend(e2e_rows(plan, device, dtype, world, not cuda))
        save()
    if run_deepseek:
        from tilefuse.bench.tp_deepseek import deepseek_rows, deepseek_summary, plan_for

        rows.extend(deepseek_rows(plan_for(quick, cuda, layers), device, dtype, world, not cuda))
        save()
    summary = summarize(rows, world)
    if run_deepseek:
        summary["deepseek"] = deepseek_summary(rows)
        summary["goals"] += summary["deepseek"]["goals"]
    if not cuda:
        from tilefuse.bench.runner import pipeline_line

        failed = [f"{r['kind']} tp={r['tp']} {r['impl']} {json.dumps(r['params'])}: "
                  f"{r.get('error') or r.get('tolerance_error')}" for r in rows
                  if r.get("error") or r.get("tolerance_error")]
        checked = len(cases) + bool(run_e2e) + bool(run_deepseek)
        summary["pipeline_check"] = {"cases": checked, "calls": len(rows), "failed": failed}
    save(summary)
    if rank == 0:
        if cuda:
            print_summary(summary, world)
        else:
            print(pipeline_line("tp", summary["pipeline_check"]))
        log(f"wrote {path}")
    return 1 if not cuda and summary["pipeline_check"]["failed"] else 0


def main(quick: bool = False, out_dir: Path = Path("bench/results"), only: str | None = None, tag: str | None = None,
         layers: int | None = None) -> int:
    """Join the ``torchrun`` group (NCCL on GPUs, gloo on CPUs) when launched by it, then :func:`run`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    joined = False
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
        joined = True
    try:
        return run(quick, out_dir, only, tag, layers)
    finally:
        if joined:
            dist.barrier()
            dist.destroy_process_group()
