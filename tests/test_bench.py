"""The benchmark's bookkeeping on hand-made rows (CPU): summaries, goals, older files, plots, tables.

Every expected number below is worked out by hand from the rows in the test."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tilefuse.bench import mla, swiglu, vq
from tilefuse.bench.harness import Ceilings, Timer, check, host_goal, tally, upgrade_rows
from tilefuse.bench.runner import print_summary


def row(family, impl, params, eager=None, graph=None, roofline=None, **extra):
    return {"family": family, "impl": impl, "params": dict(params), "flops": 1.0, "bytes": 1.0,
            "gpu_us": graph, "eager_us": eager, "graph_us": graph, "roofline_frac": roofline, **extra}


def swiglu_rows():
    small = {"model": "0.5B", "H": 896, "I": 4864, "M": 1, "dtype": "bfloat16"}
    large = {"model": "7B", "H": 3584, "I": 18944, "M": 4096, "dtype": "bfloat16"}
    return [
        row("swiglu", "tilefuse", small, eager=30.0, graph=10.0, roofline=0.5, frac_beyond_1ulp=0.0),
        row("swiglu", "cublas_gemm", small, eager=20.0, graph=12.0),
        row("swiglu", "torch_unfused", small, eager=90.0, graph=40.0, frac_beyond_1ulp=0.1),
        row("swiglu", "tilefuse", large, eager=1000.0, graph=990.0, roofline=0.8, frac_beyond_1ulp=2e-5),
        row("swiglu", "cublas_gemm", large, eager=1010.0, graph=1000.0),
        row("swiglu", "broken", large, error="RuntimeError: no"),
    ]


def test_swiglu_summary_judges_eager_and_graph_separately():
    s = swiglu.summarize(swiglu_rows())
    small, large = s["cases"]
    assert small["case"] == "0.5B M=1" and small["baseline"] == "cublas_gemm"
    assert small["eager_speedup"] == pytest.approx(20 / 30) and small["graph_speedup"] == pytest.approx(1.2)
    assert small["eager_over_graph"] == pytest.approx(3.0) and small["roofline_frac"] == 0.5
    # eager 30 us > max(1.3 x 20, 1.1 x 10) = 26 us: the host goal fails by 30 / 26
    assert small["host_goal"]["limit_us"] == pytest.approx(26.0)
    assert small["host_goal"]["measured"] == round(30 / 26, 4) and small["host_goal"]["met"] is False
    assert small["kernel_goals"][0]["measured"] == round(10 / 12, 4) and small["kernel_goals"][0]["met"] is True
    assert large["host_goal"] is None                              # M = 4096: no host-path goal
    assert large["graph_speedup"] == pytest.approx(1000 / 990)
    geo, worst, host = s["goals"]
    assert geo["measured"] == round(math.sqrt(10 / 12 * 0.99), 4) and geo["met"] is True
    assert worst["measured"] == 0.99 and worst["met"] is True
    assert (host["met_in"], host["of"], host["met"]) == (0, 1, False)
    assert s["geomean_time_over_cublas_gemm"]["eager"] == pytest.approx(math.sqrt(1.5 * 1000 / 1010))
    unfused = s["vs_torch_unfused_small_models_m<=1024"]
    assert unfused["graph"]["per_shape"] == {"0.5B M=1": 4.0} and unfused["eager"]["per_shape"] == {"0.5B M=1": 3.0}
    # the bare GEMM is 40 / 12 = 3.3x under unfused in graph mode (the 2.5x goal applies), 4.5x eager
    assert unfused["graph"]["target_2.5x_met_where_allowed"] is True
    assert s["accuracy_frac_beyond_1ulp"]["fused_max"] == 2e-5 and s["accuracy_frac_beyond_1ulp"]["fused_target_1e-4"]
    assert "best_us" not in json.dumps(s)


def test_vq_summary_speedup_goals_per_case():
    rows = []
    for shape, ours, cublas in (((28672, 8192), 25.0, 100.0), ((4096, 4096), 10.0, 30.0)):
        params = {"N": shape[0], "K": shape[1], "tokens": 1, "dtype": "float16"}
        rows += [row("vq", "tilefuse", params, eager=12.0 + ours, graph=ours, roofline=0.3),
                 row("vq", "fp16_cublas", params, eager=cublas + 5, graph=cublas)]
    params = {"N": 4096, "K": 4096, "tokens": 8, "dtype": "float16"}
    rows += [row("vq", "tilefuse", params, eager=40.0, graph=20.0),
             row("vq", "fp16_cublas", params, eager=35.0, graph=30.0)]
    s = vq.summarize(rows)
    big, small, eight = s["cases"]
    assert big["kernel_goals"][0] == {"goal": "graph speedup >= 5x at 28672x8192, 1 token", "measured": 4.0,
                                      "target": ">= 5", "met": False}
    assert small["kernel_goals"][0]["measured"] == 3.0 and small["kernel_goals"][0]["met"] is True
    assert eight["kernel_goals"][0]["goal"] == "graph speedup >= 2x at 8 tokens"
    assert eight["kernel_goals"][0]["measured"] == 1.5 and eight["kernel_goals"][0]["met"] is False
    # host goal at 8 tokens: 40 us against max(1.3 x 35, 1.1 x 20) = 45.5 us
    assert eight["host_goal"]["measured"] == round(40 / 45.5, 4) and eight["host_goal"]["met"] is True
    # the memory floor at 1 token, judged on layers of 16M weights and up (4096 x 4096 is 16M): both
    # at 0.3 of it; not at 8 tokens
    assert big["floor_us"] == pytest.approx(0.3 * 25.0) and big["kernel_goals"][1]["goal"] == vq.FLOOR_GOAL[0]
    assert small["kernel_goals"][1] == {"goal": vq.FLOOR_GOAL[0], "measured": 0.3, "target": ">= 0.7", "met": False}
    assert len(eight["kernel_goals"]) == 1 and eight["floor_us"] is None
    goals = {g["goal"]: g for g in s["goals"]}
    assert goals[vq.FLOOR_GOAL[0]]["met_in"] == 0
    assert goals["graph speedup >= 2x at 8 tokens"]["met_in"] == 0
    assert goals["graph speedup >= 3x at 4096x4096, 1 token"]["met"] is True
    assert s["batch1_speedup_geomean"]["graph"] == pytest.approx(math.sqrt(4.0 * 3.0))


def mla_rows(with_flashmla: bool):
    params = {"batch": 16, "h_q": 16, "s_q": 1, "context": 16384, "dtype": "bfloat16"}
    rows = [row("mla", "tilefuse", params, eager=60.0, graph=40.0, roofline=0.7),
            row("mla", "tilefuse+metadata", params, eager=80.0, graph=50.0, roofline=0.56),
            row("mla", "torch_naive", params, eager=500.0, graph=400.0)]
    if with_flashmla:
        rows += [row("mla", "flashmla", params, eager=50.0, graph=35.0),
                 row("mla", "flashmla+metadata", params, eager=70.0, graph=45.0)]
    return rows


def test_mla_summary_judges_the_attention_alone_per_layer():
    case = mla.summarize(mla_rows(with_flashmla=True))["cases"][0]
    assert (case["eager_impl"], case["graph_impl"], case["baseline"]) == ("tilefuse", "tilefuse", "flashmla")
    # per layer: attention alone, metadata computed once: 50 / 60 eager, 35 / 40 graph
    assert case["eager_speedup"] == pytest.approx(50 / 60) and case["graph_speedup"] == pytest.approx(35 / 40)
    assert case["eager_over_graph"] == pytest.approx(60 / 40) and case["roofline_frac"] == 0.7
    graph, eager = case["levels"]["graph"], case["levels"]["eager"]
    assert graph["step"]["speedup"] == pytest.approx(45 / 50) and eager["step"]["speedup"] == pytest.approx(70 / 80)
    # model step: metadata + 61 attentions = step + 60 x attention
    assert graph["model"]["us"] == pytest.approx(50 + 60 * 40)
    assert graph["model"]["peer_us"] == pytest.approx(45 + 60 * 35)
    assert graph["model"]["speedup"] == pytest.approx((45 + 60 * 35) / (50 + 60 * 40))
    # FlashMLA measured: eager 60 us <= 1.1 x 50 us = 55 us? no
    assert case["host_goal"]["goal"] == "eager_us <= 1.1 x flashmla eager_us"
    assert case["host_goal"]["measured"] == round(60 / 55, 4) and case["host_goal"]["met"] is False
    assert [(g["goal"], g["met"]) for g in case["kernel_goals"]] == [
        ("roofline >= 0.9 at context >= 16K", False), (mla.PEER_GOAL, False), (mla.MODEL_GOAL, False)]

    alone = mla.summarize(mla_rows(with_flashmla=False))["cases"][0]
    assert alone["baseline"] == "torch_naive" and alone["graph_speedup"] == pytest.approx(400 / 40)
    assert "levels" not in alone
    # no FlashMLA: eager 60 us <= 1.3 x own graph 40 us = 52 us? no
    assert alone["host_goal"]["goal"] == "eager_us <= 1.3 x own graph_us"
    assert alone["host_goal"]["measured"] == round(60 / 52, 4) and alone["host_goal"]["met"] is False


def test_mla_summary_judges_against_the_faster_flashmla_build():
    params = {"batch": 16, "h_q": 16, "s_q": 3, "context": "mixed<=7400", "dtype": "bfloat16"}
    rows = [row("mla", "tilefuse", params, eager=60.0, graph=40.0, roofline=0.7),
            row("mla", "tilefuse+metadata", params, eager=80.0, graph=50.0, roofline=0.56),
            row("mla", "flashmla@b31bfe7", params, eager=50.0, graph=35.0),
            row("mla", "flashmla@b31bfe7+metadata", params, eager=70.0, graph=70.0),
            row("mla", "flashmla@main", params, eager=55.0, graph=38.0),
            row("mla", "flashmla@main+metadata", params, eager=75.0, graph=60.0)]
    case = mla.summarize(rows)["cases"][0]
    # per layer the faster build is b31bfe7 (35 < 38 us alone); for the step, main (60 < 70 us)
    assert case["baseline"] == "flashmla@b31bfe7" and case["graph_baseline"] == "flashmla@b31bfe7"
    assert case["graph_speedup"] == pytest.approx(35 / 40)
    step, model = case["levels"]["graph"]["step"], case["levels"]["graph"]["model"]
    assert step["peer"] == "flashmla@main" and step["speedup"] == pytest.approx(60 / 50)
    # model step: b31bfe7 70 + 60 x 35 = 2170, main 60 + 60 x 38 = 2340: b31bfe7; tilefuse 50 + 60 x 40 = 2450
    assert model["peer"] == "flashmla@b31bfe7" and model["speedup"] == pytest.approx(2170 / 2450)
    assert case["flashmla_builds"]["flashmla@main"]["graph_speedup"] == pytest.approx(38 / 40)
    # 16 heads, 3 query tokens: slower than FlashMLA per layer, so neither bar is met
    assert [(g["goal"], g["met"]) for g in case["kernel_goals"]] == [
        (mla.PEER_GOAL, False), (mla.SHORT_GOAL, False), (mla.MODEL_GOAL, False)]


def test_mla_headline_geomean_and_cases_at_or_ahead():
    rows = []
    for context, (ours, peer) in zip((4096, 16384), ((40.0, 20.0), (10.0, 20.0))):
        params = {"batch": 16, "h_q": 128, "s_q": 1, "context": context, "dtype": "bfloat16"}
        rows += [row("mla", "tilefuse", params, eager=ours + 5, graph=ours),
                 row("mla", "tilefuse+metadata", params, eager=ours + 9, graph=ours + 4),
                 row("mla", "flashmla@main", params, eager=peer + 5, graph=peer),
                 row("mla", "flashmla@main+metadata", params, eager=peer + 9, graph=peer + 8)]
    head = mla.summarize(rows)["headline"]
    assert head["layers"] == mla.MODEL_LAYERS == 61
    # per layer, graph: time ratios 40/20 = 2 and 10/20 = 0.5, geomean 1; one case ahead
    assert head["graph"]["layer"] == {"time_ratio_geomean": pytest.approx(1.0), "at_or_ahead": 1, "of": 2}
    # step: 44/28 and 14/28
    assert head["graph"]["step"]["time_ratio_geomean"] == pytest.approx(math.sqrt(44 / 28 * 14 / 28), abs=1e-4)
    # model: (44 + 60 x 40) / (28 + 60 x 20) and (14 + 600) / (28 + 1200)
    want = math.sqrt((44 + 2400) / (28 + 1200) * (14 + 600) / (28 + 1200))
    assert head["graph"]["model"]["time_ratio_geomean"] == pytest.approx(want, abs=1e-4)
    assert head["eager"]["layer"]["time_ratio_geomean"] == pytest.approx(math.sqrt(45 / 25 * 15 / 25), abs=1e-4)
    assert mla.model_step_us(None, 3.0) is None and mla.model_step_us(5.0, 2.0, layers=3) == 9.0


def test_mla_page_size_cases_are_their_own_cases():
    """A case at pages of 16 tokens shares batch, heads and context with the 64-token case; it is a
    case of its own (labelled with its page size), and the 64-token case keeps its own rows."""
    rows = mla_rows(with_flashmla=True)
    paged = {**rows[0]["params"], "page": 16}
    rows += [row("mla", "tilefuse", paged, eager=90.0, graph=80.0, roofline=0.3),
             row("mla", "tilefuse+metadata", paged, eager=95.0, graph=85.0, roofline=0.3)]
    cases = {c["case"]: c for c in mla.summarize(rows)["cases"]}
    assert set(cases) == {"b16 h16 s1 16384", "b16 h16 s1 16384, page 16"}
    assert cases["b16 h16 s1 16384"]["graph_us"] == 40.0 and cases["b16 h16 s1 16384"]["baseline"] == "flashmla"
    assert cases["b16 h16 s1 16384, page 16"]["graph_us"] == 80.0 and cases["b16 h16 s1 16384, page 16"]["baseline"] is None


def test_mla_fp8_cases_are_summarized_apart_against_the_padded_flashmla():
    """The FP8-cache rows leave the main table; each sparse case is judged by graph time against
    the faster sparse FlashMLA build's +metadata row (not its precomputed-schedule row), the 8-
    and 16-head goals tally only their own heads, and the bf16 dense row gives the second ratio."""
    params = {"batch": 128, "h_q": 16, "s_q": 1, "context": 32768, "topk": 2048, "kv": "fp8", "dtype": "bfloat16"}
    p8 = dict(params, h_q=8)
    rows = mla_rows(with_flashmla=True)
    for p, ours in ((params, 50.0), (p8, 60.0)):
        rows += [row("mla", "tilefuse", p, eager=70.0, graph=ours, roofline=0.5),
                 row("mla", "tilefuse:dense-bf16", p, eager=40.0, graph=25.0),
                 row("mla", "flashmla@main", p, eager=90.0, graph=80.0),
                 row("mla", "flashmla@main+metadata", p, eager=130.0, graph=120.0)]
    s = mla.summarize(rows)
    assert len(s["cases"]) == 1            # the main table keeps the dense 16-bit case only
    h16, h8 = sorted(s["fp8_cache"]["cases"], key=lambda e: -e["params"]["h_q"])
    assert h16["peer"] == "flashmla@main+metadata" and h16["speedup_vs_peer"] == pytest.approx(120 / 50)
    assert h16["speedup_vs_dense_bf16"] == pytest.approx(25 / 50)
    goals = {g["goal"]: g for g in s["fp8_cache"]["goals"]}
    assert goals["sparse h16: graph speedup over FlashMLA padded >= 2"]["met"] is True
    assert goals["sparse h8: graph speedup over FlashMLA padded >= 3"]["met_in"] == 0    # 120 / 60 = 2x < 3x
    assert goals["sparse h8: graph speedup over FlashMLA padded >= 3"]["of"] == 1


def test_host_goal_with_a_term_missing():
    entry = {"baseline": "cublas_gemm", "eager_us": 25.0, "baseline_eager_us": 20.0, "eager_over_graph": None}
    assert host_goal(entry, 1.3, 1.1)["met"] is True            # under 1.3 x 20 = 26 whatever the graph term
    entry["eager_us"] = 30.0
    assert host_goal(entry, 1.3, 1.1)["met"] is None            # over 26, but 1.1 x graph_us is unknown
    assert host_goal(entry, 1.3)["met"] is False                # only the baseline term: judged
    assert check("x", None, "<=", 1)["met"] is None
    assert tally("t", [None, {"met": None}, {"met": True}, {"met": False}]) == {"goal": "t", "met_in": 1, "of": 2,
                                                                                "met": False}


def test_older_rows_are_read_without_inventing_eager_times():
    old = [{"family": "mla", "impl": "tilefuse", "params": {}, "median_us": 400.0, "graph_us": 100.0,
            "host_us": 380.0, "tflops": 2.0, "gbps": 3.0, "roofline_frac": 0.5},
           {"family": "mla", "impl": "torch_naive", "params": {}, "median_us": 900.0, "tflops": 1.0, "gbps": 1.0,
            "roofline_frac": 0.1}]
    new, naive = upgrade_rows(old, {"tilefuse": "tilefuse+metadata"})
    assert new["impl"] == "tilefuse+metadata" and new["gpu_us"] == 400.0 and new["graph_us"] == 100.0
    assert "eager_us" not in new and "median_us" not in new and "host_us" not in new and new["legacy_schema"]
    assert new["flops"] == pytest.approx(2.0 * 400 * 1e6) and new["bytes"] == pytest.approx(3.0 * 400 * 1e3)
    assert new["tflops"] == pytest.approx(8.0) and new["gbps"] == pytest.approx(12.0)
    assert new["roofline_frac"] == pytest.approx(0.5)           # roofline 50 us (0.5 of min(400, 100)) / 100 us
    assert naive["tflops"] is None and naive["roofline_frac"] is None   # no graph replay: no rates
    assert upgrade_rows(new_rows := [dict(new, legacy_schema=False)]) == new_rows  # new rows pass through


def test_a_case_whose_inputs_cannot_be_built_is_an_error_row():
    """A case whose setup raises (a cache too large for the GPU) is recorded and the run goes on."""
    from tilefuse.bench.harness import Case, run_case

    def setup():
        raise RuntimeError("CUDA out of memory. Tried to allocate 72.00 GiB")

    rows = run_case(Case({"batch": 256}, 1.0, 2.0, setup), "mla", Timer(torch.device("cpu")), Ceilings(None, None))
    assert rows == [{"family": "mla", "impl": "setup", "params": {"batch": 256}, "flops": 1.0, "bytes": 2.0,
                     "error": "RuntimeError: CUDA out of memory. Tried to allocate 72.00 GiB"}]


def test_eager_timer_loops_long_enough():
    """A call that takes 1 ms of a fake clock, 5 ms loops: warm-up 1 call, calibration 1 then
    max(2, ceil(1.2 x 1 x 5 / 1)) = 6 calls (6 ms >= 5 ms), then two more loops of 6."""
    now = [0.0]
    calls = []

    def call():
        calls.append(1)
        now[0] += 1e-3

    us, n = Timer(torch.device("cpu"), eager_ms=5.0, clock=lambda: now[0]).eager_us(call)
    assert n == 6 and us == pytest.approx(1000.0) and len(calls) == 1 + 1 + 3 * 6
    assert Ceilings(2.0, 4.0).roofline_us(8e12, 1e9) == pytest.approx(2e6)


@pytest.mark.parametrize("family, rows", [("swiglu", swiglu_rows()), ("mla", mla_rows(True)), ("mla", mla_rows(False))])
def test_plots_and_tables_from_hand_made_rows(family, rows, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tilefuse.bench.plot import plot_family

    summary = {"swiglu": swiglu, "mla": mla}[family].summarize(rows)
    plot_family(family, summary, tmp_path / "p.png", title="test")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    print_summary(family, summary)
    out = capsys.readouterr().out
    assert summary["cases"][0]["case"] in out and "FAIL" in out and "goals:" in out


def test_older_results_file_is_resummarized_and_replotted(tmp_path):
    pytest.importorskip("matplotlib")
    from tilefuse.bench.runner import resummarize

    params = {"model": "7B", "H": 3584, "I": 18944, "M": 1, "dtype": "bfloat16"}
    rows = [{"family": "swiglu", "impl": impl, "params": params, "median_us": med, "graph_us": graph, "host_us": 50.0,
             "tflops": 1.0, "gbps": 2.0, "roofline_frac": 0.5}
            for impl, med, graph in (("tilefuse", 90.0, 80.0), ("cublas_gemm", 85.0, 84.0))]
    path = tmp_path / "swiglu-h200.json"
    path.write_text(json.dumps({"machine": {"gpu": "NVIDIA H200", "date": "2026-11-29", "torch": "2", "triton": "3"},
                                "rows": rows, "summary": {"best": 1}}))
    family, summary = resummarize(path)
    data = json.loads(path.read_text())
    assert family == "swiglu" and data["rows"] == rows and data["summary"] == json.loads(json.dumps(summary))
    case = summary["cases"][0]
    assert case["graph_speedup"] == pytest.approx(84 / 80) and case["eager_speedup"] is None and case["legacy_schema"]
    assert case["roofline_frac"] == pytest.approx(0.5)          # 0.5 of min(90, 80) = graph_us: unchanged
    assert case["host_goal"]["met"] is None and data["timing"]["mode"] == "gpu"
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_tools_configs_file_sections(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    try:
        import sweep_common
    finally:
        sys.path.pop(0)
    base = {"vq": {"resident": {"block_r": 64, "num_warps": 8}, "gather": {"block_n": 128}},
            "swiglu": [{"H": 1, "I": 2, "M": 1, "config": {"a": 1}}, {"H": 1, "I": 2, "M": 16, "config": {}}]}
    merged = sweep_common.merge_section(base, "vq", {"resident": {"block_r": 128}})
    assert merged["vq"] == {"resident": {"block_r": 128, "num_warps": 8}, "gather": {"block_n": 128}}
    merged = sweep_common.merge_section(merged, "swiglu", [{"H": 1, "I": 2, "M": 1, "config": {"a": 2}}])
    assert merged["swiglu"] == [{"H": 1, "I": 2, "M": 16, "config": {}}, {"H": 1, "I": 2, "M": 1, "config": {"a": 2}}]
    path = tmp_path / "configs.json"
    sweep_common.update_section(path, "mla", {"transposed:long": {"BLOCK_N": 64}, "small_rows_variant": {"long": "x"}})
    sweep_common.update_section(path, "mla", {"small_rows_variant": {"short": "y"}})
    assert json.loads(path.read_text()) == {"mla": {"transposed:long": {"BLOCK_N": 64},
                                                    "small_rows_variant": {"long": "x", "short": "y"}}}
    assert base["vq"]["resident"] == {"block_r": 64, "num_warps": 8}     # the input is not modified


GPU_TOOLS = ["tune_swiglu.py", "mla_sweep.py", "vq_decode_sweep.py", "vq_mma_sweep.py", "vq_prefill_sweep.py",
             "vq_layer_probe.py", "sanitize.py", "sync_probe.py", "mla_metadata_time.py", "mla_split_cost_sweep.py",
             "mla_fp8_sweep.py", "vq_moe_bench.py", "mla_kernel_times.py"]


def run_tool(tool: str, *args: str, gpu: bool = True):
    """``python3 tools/<tool> ARGS``; with ``gpu=False`` it sees no CUDA GPU and no Triton interpreter."""
    import os
    import subprocess

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    script = Path(__file__).parents[1] / "tools" / tool
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.parametrize("tool", [*GPU_TOOLS, "replot.py", "vq_quality.py", "pv_tuning_check.py",
                                  "mla_schedule_sim.py"])
def test_tools_help_works_without_a_gpu(tool):
    done = run_tool(tool, "--help", gpu=False)
    assert done.returncode == 0 and "usage:" in done.stdout and "Traceback" not in done.stderr


def test_schedule_sim_checks_the_pick_on_random_mixes(tmp_path):
    """tools/mla_schedule_sim.py on a CPU: the benchmark's mixes with a pick each, and --random N
    counting the mixes long enough to weigh and where the pick differs from the simulated one."""
    done = run_tool("mla_schedule_sim.py", gpu=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    picks = [line.rsplit("|", 1)[1].strip() for line in done.stdout.splitlines()[1:]]
    assert picks and set(picks) == {"slots", "parts"}
    done = run_tool("mla_schedule_sim.py", "--random", "200", gpu=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    head = done.stdout.splitlines()[0]
    assert head.startswith("200 random mixes, ") and "differs from the same rule" in head
    saved = tmp_path / "mixes.json"
    done = run_tool("mla_schedule_sim.py", "--random", "1000", "--write", str(saved), gpu=False)
    mixes = json.loads(saved.read_text())
    assert done.returncode == 0 and mixes and all(sum(m["lengths"]) <= 16 << 20 for m in mixes)
    differ = [m for m in mixes if m["pick"] != m["by_simulation"]]
    assert differ and len(mixes) <= 2 * len(differ) and {m["parts"] for m in mixes} <= {66, 132}


@pytest.mark.parametrize("tool", GPU_TOOLS)
def test_gpu_tools_say_in_one_line_that_they_need_a_gpu(tool, tmp_path):
    args = {"sanitize.py": ("--one",), "sync_probe.py": ()}.get(tool, (str(tmp_path),))
    done = run_tool(tool, *args, gpu=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"tools/{tool}: needs a CUDA GPU")
    assert not list(tmp_path.iterdir())


def test_sweep_defaults(monkeypatch):
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    try:
        import sweep_common
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sweep_common, "require_gpu", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    args = sweep_common.parse_args("doc", [])
    assert args.out_dir is None and args.configs == Path("configs.json") and args.quick is False
    assert sweep_common.sweep_path("mla-sweep", args.out_dir) == Path("bench/results/sweeps/mla-sweep-h200.json")
    args = sweep_common.parse_args("doc", ["out", "--quick"])
    assert args.configs == Path("out/configs.json") and args.quick
    assert sweep_common.sweep_path("vq-mma-sweep", args.out_dir) == Path("out/vq-mma-sweep-h200.json")
    assert not hasattr(sweep_common.parse_args("doc", [], configs=False), "configs")


def test_replot_refuses_a_cpu_pipeline_check_in_one_line(tmp_path):
    path = tmp_path / "vq-cpu-x86-64.json"
    path.write_text(json.dumps({"timing": {"mode": "cpu-pipeline-check"}, "rows": [{"family": "vq"}]}))
    done = run_tool("replot.py", str(path), gpu=False)
    assert done.returncode == 1 and "nothing was timed" in done.stderr and "Traceback" not in done.stderr


def test_every_x_column_is_a_speedup(capsys):
    """Model and tp tables print "x" as stock's (or TP=1 stock's) time over this one's, as the kernel
    families print baseline time / tilefuse time, and say so above the table."""
    from tilefuse.bench import model as bench_model
    from tilefuse.bench import tp

    def decode(variant, ms):
        return {"model": "m", "variant": variant, "mode": "graph", "batch": 1, "ms_per_token": ms}

    rows = [decode("stock", 10.0), decode("swiglu", 5.0)]
    bench_model.compare(rows, {})
    bench_model.print_table(rows, bench_model.summarize(rows))
    out = capsys.readouterr().out
    assert "x stock: speedup = stock ms/token / this ms/token" in out and " 2.00x " in out
    e2e = [{"kind": "e2e", "tp": tp_, "impl": impl, "mode": "graph", "params": {"batch": 1}, "ms_per_token": ms,
            "agreement_vs_tp1_stock": 1.0} for tp_, impl, ms in ((1, "stock", 8.0), (2, "shard_model", 4.0))]
    summary = tp.summarize(e2e, 2)
    assert [e["speedup_over_tp1_stock"] for e in summary["e2e"]] == [1.0, 2.0]
    tp.print_summary(summary, 2)
    out = capsys.readouterr().out
    assert "speedup = TP=1 stock ms/token / this ms/token" in out and "2.00x TP=1 stock" in out


def test_two_flashmla_builds_load_side_by_side(tmp_path, monkeypatch):
    from tilefuse import _env

    for label in ("old", "new"):
        (tmp_path / label / "flash_mla").mkdir(parents=True)
        (tmp_path / label / "flash_mla" / "__init__.py").write_text(f"BUILD = {label!r}\n")
    monkeypatch.setenv("TILEFUSE_FLASHMLA", f"b31bfe7={tmp_path / 'old'},main={tmp_path / 'new'}")
    monkeypatch.setattr(mla, "_PEERS", None)
    _env.reload()
    try:
        peers = mla.flashmla_peers()
        assert {name: module.BUILD for name, module in peers.items()} == {"flashmla@b31bfe7": "old",
                                                                           "flashmla@main": "new"}
        assert "flash_mla" not in sys.modules and str(tmp_path / "old") not in sys.path
        monkeypatch.setenv("TILEFUSE_FLASHMLA", "main")
        with pytest.raises(ValueError, match="TILEFUSE_FLASHMLA: expected label=path"):
            _env.reload()
    finally:
        monkeypatch.delenv("TILEFUSE_FLASHMLA")
        _env.reload()
        mla._PEERS = None


def test_vq_profile_summary_splits_the_samples_by_stage():
    """tools/vq_profile_summary.py on a made-up profile: the prologue ends at the build's first FMA,
    the loop runs from its backward branch's target to that branch, the epilogue follows."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    try:
        import vq_profile_summary
    finally:
        sys.path.pop(0)
    sass = [("0x100", "LDG.E R4, desc[UR4][R2.64]", 2, 2, 0), ("0x110", "FFMA R5, R4, R4, RZ", 6, 0, 1),
            ("0x120", "STS [R6], R5", 6, 0, 3), ("0x130", "MOV R14, R3", 40, 9, 0),
            ("0x140", "PRMT R25, R8, 0x7604, R21", 40, 0, 5), ("0x150", "@!P0 BRA 0x130", 40, 0, 1),
            ("0x160", "BAR.SYNC.DEFER_BLOCKING 0x0", 2, 0, 0), ("0x170", "EXIT", 2, 0, 0)]
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_math"'
    lines = [f'"{a}","{op}","{ls + m}","{ex}","{ls}","{m}"' for a, op, ex, ls, m in sass]
    source = '"Kernel Name","vq_decode_resident_kernel",\n' + "\n".join([head, *lines])
    details = "  vq_decode_resident_kernel (8, 16, 1)x(512, 1, 1)\n    Duration    us    33.66\n"
    [case] = vq_profile_summary.summarize(details, source, [(28672, 8192)])
    assert case["duration_us"] == 33.66 and case["stall_samples"] == 21
    shares = {stage: r["share"] for stage, r in case["regions"].items()}
    assert shares == {"prologue": round(2 / 21, 3), "table build": round(4 / 21, 3),
                      "streaming loop": round(15 / 21, 3), "epilogue": 0.0}
    assert case["regions"]["streaming loop"]["top_stalls"] == {"long_sb": 0.6, "math": 0.4}
    assert case["hottest_instruction"] == dict(sass="MOV R14, R3", share=round(9 / 21, 3), top_stall="long_sb")
