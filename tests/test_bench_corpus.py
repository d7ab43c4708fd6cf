"""``tilefuse bench corpus`` (CPU): the pipeline check, the case list, and the summary on hand-made rows.

Every expected number below is worked out by hand from the rows in the test."""

import json
import math
import re

import pytest
import torch

from tilefuse.bench import corpus as bench_corpus
from tilefuse.bench.runner import FAMILIES, STANDALONE, print_summary
from tilefuse.testing import corpus

RATIO = re.compile(r"\d+(\.\d+)?x\b|\bx\d+\.\d")    # "1.23x", "x1.23": a ratio as tables print them
GROUPS = {(op, b) for op in bench_corpus.OPS for b in bench_corpus.BUCKETS}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ----------------------------------------------------------------------------- the CPU pipeline check
def test_cpu_pipeline_check_runs_and_prints_no_ratio(tmp_path, no_gpu, capsys):
    from tilefuse.cli import main

    assert main(["bench", "corpus", "--quick", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "corpus: pipeline check: 10 cases ran on the reference path, nothing timed\n"
    for text in (captured.out, captured.err):
        assert not RATIO.search(text), RATIO.search(text)
        for word in ("ceilings", "GB/s", "TFLOP/s", "[ok]", "FAIL", "goal", "estimated"):
            assert word not in text, word
    assert len(re.findall(r"^\[corpus \d+/10\] ", captured.err, re.M)) == 10      # progress, one line per case
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("corpus-cpu-") and path.name.endswith("-quick.json")
    data = json.loads(path.read_text())
    assert data["timing"]["mode"] == "cpu-pipeline-check"
    assert data["summary"] == {"pipeline_check": {"cases": 10, "calls": 30, "failed": []}}
    assert {(r["params"]["op"], r["params"]["bucket"]) for r in data["rows"]} == GROUPS
    assert {r["impl"] for r in data["rows"]} == {*bench_corpus.IMPLS["swiglu"], *bench_corpus.IMPLS["vq"]}
    keys = {k for r in data["rows"] for k in r}
    assert not [k for k in keys if k.endswith(("_us", "speedup"))], keys
    for r in data["rows"]:          # small shapes: scaled to <= 256, multiples of 64
        a, b = (int(d) for d in r["params"]["dims"].split("x"))
        assert a <= 256 and b <= 256 and a % 64 == 0 and b % 64 == 0 and r["params"]["scaled_from"]


def test_corpus_is_run_by_name_only():
    from tilefuse.cli import BENCH_HELP

    assert "corpus" in STANDALONE and "corpus" not in FAMILIES and "corpus" in BENCH_HELP
    assert "corpus" in BENCH_HELP["all"]          # "... (not tp or corpus)"


# ----------------------------------------------------------------------------- the case list
@pytest.mark.parametrize("quick", [True, False])
def test_case_list_is_deterministic_and_covers_every_bucket(quick):
    first, again = bench_corpus.plan(quick), bench_corpus.plan(quick)
    assert first == again
    assert {(p["op"], p["bucket"]) for p in first} == GROUPS
    pick = corpus.quick_cases if quick else corpus.cases
    for op in bench_corpus.OPS:        # exactly the corpus's cases, each once
        mine = sorted((p["dims"], p["tokens"]) for p in first if p["op"] == op)
        theirs = sorted(("x".join(map(str, s.dims)), t) for s, t in pick(bench_corpus.CORPUS_OP[op]))
        assert mine == theirs
    for p in first:
        assert p["bucket"] == corpus.bucket_of(p["tokens"])
        assert p["held_out"] == (p["model"] in corpus.HELD_OUT)
    assert [int(p["slice"].split("/")[0]) for p in first] == [i % bench_corpus.SLICES for i in range(len(first))]


def test_full_run_interleaves_ops_and_buckets():
    """A run cut short, and every slice, is a fair subsample: each (op, bucket) group and the
    held-out models of both ops show up early and in every slice."""
    full = bench_corpus.plan(False)
    assert {(p["op"], p["bucket"]) for p in full[:60]} == GROUPS
    for s in range(bench_corpus.SLICES):
        part = [p for p in full if p["slice"] == f"{s}/{bench_corpus.SLICES}"]
        assert {(p["op"], p["bucket"]) for p in part} == GROUPS
        assert {p["op"] for p in part if p["held_out"]} == {"swiglu", "vq"}
    # the slices' share of the run time is even (within 10 %) and each fits a 10-minute command
    times = [bench_corpus.estimate_s([p for p in full if p["slice"] == f"{s}/{bench_corpus.SLICES}"])
             for s in range(bench_corpus.SLICES)]
    assert max(times) < 1.1 * min(times) and max(times) < 600
    assert bench_corpus.estimate_s(bench_corpus.plan(True), 20.0) < 600


def test_gpu_cases_are_built_lazily(capsys):
    """The GPU's cases can be listed anywhere: nothing is allocated before setup()."""
    built = bench_corpus.cases(torch.device("cuda"), quick=True)
    assert [c.params for c in built] == bench_corpus.plan(True)
    assert "corpus: 135 cases (swiglu 70, vq 65), 12 slices; estimated" in capsys.readouterr().err
    swiglu = next(c for c in built if c.params["op"] == "swiglu")
    h, i, m = swiglu.params["H"], swiglu.params["I"], swiglu.params["tokens"]
    assert swiglu.flops == 4.0 * m * i * h and swiglu.bytes == 2.0 * (m * h + 2 * i * h + m * i)


# ----------------------------------------------------------------------------- the summary
def row(impl, params, eager, graph):
    return {"family": "corpus", "impl": impl, "params": dict(params), "flops": 1.0, "bytes": 1.0,
            "gpu_us": graph, "eager_us": eager, "graph_us": graph}


def swiglu_params(model, dims, tokens, held_out=False):
    h, i = dims
    return {"op": "swiglu", "model": model, "role": "mlp", "tp": 1, "held_out": held_out,
            "bucket": corpus.bucket_of(tokens), "tokens": tokens, "dims": f"{h}x{i}", "H": h, "I": i,
            "dtype": "bfloat16", "slice": "0/12"}


def vq_params(model, dims, tokens):
    n, k = dims
    return {"op": "vq", "model": model, "role": "o", "tp": 1, "held_out": False, "bucket": corpus.bucket_of(tokens),
            "tokens": tokens, "dims": f"{n}x{k}", "N": n, "K": k, "dtype": "float16", "slice": "0/12"}


A = swiglu_params("a", (4096, 14336), 1)
B = swiglu_params("b", (7168, 2048), 1)               # slower than the unfused code: must be flagged
C = swiglu_params("c", (5120, 8192), 333)             # 2x faster than unfused, but 1.2x the GEMM's time
H = swiglu_params("phi4-14b", (5120, 17920), 1, held_out=True)
V1 = vq_params("v", (4096, 4096), 1)                  # N*K = 16M: the 2x goal applies
V33 = vq_params("v", (4096, 4096), 33)
V333 = vq_params("v", (2048, 4096), 333)
V1000 = vq_params("v", (2048, 4096), 1000)            # above 512 tokens: reported only


def synthetic_rows():
    return [
        # (impl, params, eager_us, graph_us)
        row("tilefuse", A, 20.0, 10.0), row("torch_unfused", A, 30.0, 12.0), row("cublas_gemm", A, 19.0, 11.0),
        row("tilefuse", B, 30.0, 10.5), row("torch_unfused", B, 40.0, 10.0), row("cublas_gemm", B, 25.0, 9.0),
        row("tilefuse", C, 60.0, 60.0), row("torch_unfused", C, 120.0, 120.0), row("cublas_gemm", C, 50.0, 50.0),
        row("tilefuse", H, 20.0, 20.0), row("torch_unfused", H, 20.0, 19.0), row("cublas_gemm", H, 20.0, 20.0),
        row("tilefuse", V1, 12.0, 6.0), row("fp16_dense", V1, 14.0, 10.0), row("dequant_cublas", V1, 40.0, 30.0),
        row("tilefuse", V33, 20.0, 20.0), row("fp16_dense", V33, 15.0, 15.0), row("dequant_cublas", V33, 25.0, 25.0),
        row("tilefuse", V333, 50.0, 45.0), row("fp16_dense", V333, 40.0, 40.0),
        row("dequant_cublas", V333, 60.0, 50.0),
        row("tilefuse", V1000, 90.0, 90.0), row("fp16_dense", V1000, 60.0, 60.0),
        row("dequant_cublas", V1000, 80.0, 80.0),
        {**row("broken", A, None, None), "error": "RuntimeError: no"},
    ]


def goals_by_name(summary):
    return {g["goal"]: g for g in summary["goals"]}


def test_summary_worst_and_geomean_per_bucket():
    s = bench_corpus.summarize(synthetic_rows())
    one = s["buckets"]["swiglu"]["corpus"]["1"]
    graph, eager = one["graph"], one["eager"]
    assert graph["cases"] == 2
    assert graph["worst_over_torch_unfused"] == pytest.approx(10.5 / 10.0)
    assert graph["worst_case"] == bench_corpus.label(B)
    assert graph["geomean_over_cublas_gemm"] == pytest.approx(math.sqrt(10 / 11 * 10.5 / 9))
    assert graph["max_over_cublas_gemm"] == pytest.approx(10.5 / 9)
    assert eager["worst_over_torch_unfused"] == pytest.approx(30 / 40)      # eager judged on its own times
    assert eager["geomean_over_cublas_gemm"] == pytest.approx(math.sqrt(20 / 19 * 30 / 25))
    # the held-out model is reported apart, never mixed into the corpus's bucket
    assert s["buckets"]["swiglu"]["held_out"]["1"]["graph"]["worst_over_torch_unfused"] == pytest.approx(20 / 19)
    assert s["buckets"]["swiglu"]["corpus"]["129-1024"]["graph"]["max_over_cublas_gemm"] == pytest.approx(1.2)

    goals = goals_by_name(s)
    assert goals["swiglu corpus tokens 1 graph: worst tilefuse / torch_unfused time"]["met"] is False
    assert goals["swiglu corpus tokens 1 graph: worst tilefuse / torch_unfused time"]["measured"] == round(1.05, 4)
    assert goals["swiglu corpus tokens 1 eager: worst tilefuse / torch_unfused time"]["met"] is True
    assert goals["swiglu corpus tokens 1 graph: geomean tilefuse / cublas_gemm time"]["met"] is False  # 1.03 > 0.97
    assert goals["swiglu corpus tokens 1 graph: max tilefuse / cublas_gemm time"]["met"] is False      # 1.17 > 1.10
    assert goals["swiglu held-out tokens 1 graph: worst tilefuse / torch_unfused time"]["met"] is False  # 1.053
    assert not [g for g in goals if "held-out tokens 2-16" in g]            # no case there: no goal


def test_summary_flags_a_case_slower_than_its_baseline():
    s = bench_corpus.summarize(synthetic_rows())
    case = {e["case"]: e for e in s["cases"]}
    b, a = case[bench_corpus.label(B)], case[bench_corpus.label(A)]
    assert b["baseline"] == "torch_unfused" and b["graph_speedup"] == pytest.approx(10 / 10.5)
    slower = next(g for g in b["kernel_goals"] if g["goal"] == "graph: tilefuse / torch_unfused time")
    assert slower["met"] is False and slower["measured"] == round(1.05, 4) and slower["target"] == "<= 1.02"
    assert all(g["met"] for g in a["kernel_goals"])
    assert bench_corpus.label(B) in s["misses"] and bench_corpus.label(A) not in s["misses"]
    tallies = goals_by_name(s)
    # graph: A meets both, B misses both, C misses the GEMM one, H misses the unfused one
    graph = tallies["swiglu graph: cases that meet every per-case goal"]
    assert (graph["met_in"], graph["of"], graph["met"]) == (1, 4, False)


def test_vq_targets_per_token_range():
    s = bench_corpus.summarize(synthetic_rows())
    case = {e["case"]: e for e in s["cases"]}
    one = {g["goal"]: g for g in case[bench_corpus.label(V1)]["kernel_goals"]}
    assert one["graph: tilefuse / fp16_dense time"]["met"] is True                  # 0.6 <= 1
    assert one["graph: tilefuse / fp16_dense time, 1 token, N*K >= 8M"]["met"] is False   # 0.6 > 0.5: not 2x
    assert one["eager: tilefuse / fp16_dense time, 1 token, N*K >= 8M"]["measured"] == round(12 / 14, 4)
    # 33 tokens: slower than dense (reported), judged against dequantize + cuBLAS (0.8: met)
    assert [(g["goal"], g["met"]) for g in case[bench_corpus.label(V33)]["kernel_goals"]] == [
        ("graph: tilefuse / dequant_cublas time", True), ("eager: tilefuse / dequant_cublas time", True)]
    assert case[bench_corpus.label(V33)]["graph_speedup"] == pytest.approx(15 / 20)  # the x: fp16_dense / tilefuse
    assert case[bench_corpus.label(V1000)]["kernel_goals"] == []                     # above 512: report only
    stats = s["buckets"]["vq"]["corpus"]["129-1024"]["graph"]
    assert stats["worst_over_dequant_cublas_17-512"] == pytest.approx(45 / 50)       # 333 judged, 1000 not
    assert stats["worst_over_fp16_dense"] == pytest.approx(90 / 60)                  # reported over both
    goals = goals_by_name(s)
    assert goals["vq corpus tokens 129-1024 graph: worst tilefuse / dequant_cublas time (<= 512 tokens)"]["met"]
    assert goals["vq corpus tokens 1 graph: worst tilefuse / fp16_dense time at N*K >= 8M"]["met"] is False
    assert not [g for g in goals if g.startswith("vq corpus tokens 1025-16384")]


def test_table_speedups_and_plot(tmp_path, capsys):
    s = bench_corpus.summarize(synthetic_rows())
    print_summary("corpus", s)
    out = capsys.readouterr().out
    assert "tilefuse time / baseline time" in out and "* = misses its target" in out
    line = next(l for l in out.splitlines() if l.strip().startswith(bench_corpus.label(C)))
    assert " 2.00x " in line and "torch_unfused" in line       # speedup = baseline time / tilefuse time
    assert "[FAIL] swiglu corpus tokens 1 graph: worst tilefuse / torch_unfused time: 1.050" in out
    assert "1.050*" in out                                      # the bucket cell marked as missing its target
    pytest.importorskip("matplotlib")
    from tilefuse.bench.plot import plot_family

    plot_family("corpus", s, tmp_path / "p.png", title="test")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_slices(tmp_path):
    pytest.importorskip("matplotlib")
    rows = synthetic_rows()
    head = {"machine": {"gpu": "NVIDIA H200", "date": "2026-12-01", "torch": "2", "triton": "3"},
            "timing": {"mode": "gpu"}}
    first, second = tmp_path / "s0.json", tmp_path / "s1.json"
    first.write_text(json.dumps({**head, "rows": rows[:12], "incomplete": True}))
    second.write_text(json.dumps({**head, "rows": rows[12:]}))
    out = tmp_path / "corpus-h200.json"
    summary = bench_corpus.merge(out, [first, second])
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(rows) and "incomplete" not in data and data["merged_from"] == [str(first),
                                                                                                   str(second)]
    assert len(summary["cases"]) == 8 and out.with_suffix(".png").exists()
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"timing": {"mode": "cpu-pipeline-check"}, "rows": []}))
    with pytest.raises(ValueError, match="pipeline check"):
        bench_corpus.merge(tmp_path / "x.json", [cpu])
