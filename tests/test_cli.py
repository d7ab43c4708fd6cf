"""The ``tilefuse`` command works on any machine (on a CPU it benchmarks the reference path)."""

import json
import subprocess
import sys

import pytest

from tilefuse.bench.harness import Case, Ceilings, Timer, run_case
from tilefuse.bench.runner import header, write_results


def test_info_runs(capsys):
    from tilefuse.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "kernels:" in out


def test_module_entry_point_help():
    done = subprocess.run([sys.executable, "-m", "tilefuse", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "bench" in done.stdout


def test_bad_family_is_rejected(capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err


def test_run_case_rows_and_json_shape(tmp_path, capsys):
    """On a CPU a row has eager_us only (no GPU times, no rates); the file says it is a pipeline check."""
    import torch

    calls = []

    def setup():
        x = torch.randn(64, 64)
        return {"tilefuse": lambda: calls.append(1) or x @ x, "torch_eager": lambda: x @ x,
                "broken": lambda: 1 / 0}

    case = Case(params={"n": 64, "dtype": "float32"}, flops=2 * 64 ** 3, bytes=3 * 64 * 64 * 4, setup=setup,
                extras=lambda impls: {"tilefuse": {"rel_err": 0.0}})
    timer = Timer(torch.device("cpu"), rep_ms=5, eager_ms=2)
    rows = run_case(case, "toy", timer, Ceilings(100.0, 1.0))
    assert [r["impl"] for r in rows] == ["tilefuse", "torch_eager", "broken"]
    assert rows[0]["eager_us"] > 0 and rows[0]["eager_calls"] >= 1 and rows[0]["rel_err"] == 0.0 and calls
    assert rows[0]["flops"] == 2 * 64 ** 3 and rows[0]["bytes"] == 3 * 64 * 64 * 4
    for key in ("gpu_us", "graph_us", "tflops", "roofline_frac", "median_us", "best_us", "host_us"):
        assert key not in rows[0]
    assert "eager_us" not in rows[2] and "ZeroDivisionError" in rows[2]["error"]
    head = header(torch.device("cpu"), Ceilings(0.0, 0.0), timer)
    assert head["timing"]["mode"] == "cpu-pipeline-check" and set(head["timing"]["fields"]) >= {"eager_us", "graph_us"}
    assert set(head["machine"]) >= {"gpu", "torch", "triton", "date", "env", "config_overrides"}
    path = write_results("toy", rows, head, tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == {"machine", "ceilings", "timing", "rows", "incomplete"}
    assert set(data["ceilings"]) == {"copy_gbps", "gemm_bf16_tflops"}
    assert not path.with_suffix(".png").exists()    # no summary yet: no plot


def test_only_runs_are_tagged_and_saved_case_by_case(tmp_path, monkeypatch, capsys):
    """A --only run writes <family>-<gpu>-only.json (never the full run's file), and the rows are
    saved after every case, so a run cut short by a timeout still leaves them; stdout is the table."""
    from tilefuse.bench import runner

    saved = []
    real_write = runner.write_results

    def spy(family, rows, head, out_dir, summary=None, **kwargs):
        saved.append((len(rows), kwargs.get("tag"), summary is not None))
        return real_write(family, rows, head, out_dir, summary, **kwargs)

    monkeypatch.setattr(runner, "write_results", spy)
    assert runner.main(["vq"], quick=True, out_dir=tmp_path, only='"tokens": 8', rep_ms=1.0) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.startswith("vq-cpu-") for f in files), files
    assert files[0].endswith("-quick-only.json") and files[1] == files[0].replace(".json", ".png")
    partial = [s for s in saved if not s[2]]
    assert len(partial) == 2 and all(tag == "only" for _, tag, _ in saved) and saved[-1][2]
    assert [n for n, _, _ in partial] == sorted(n for n, _, _ in partial)  # rows grow case by case
    out = capsys.readouterr().out
    assert "64x128 8 tok float16" in out and "vq goals:" in out and '"rows"' not in out
    assert runner.result_path("mla", {"gpu": "NVIDIA H200"}, tmp_path, tag="h16s1").name == "mla-h200-h16s1.json"


def test_only_matching_nothing_writes_nothing(tmp_path, capsys):
    from tilefuse.cli import main

    assert main(["bench", "swiglu", "--only", "no-such-case", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no-such-case" in err and "swiglu" in err
    assert not list(tmp_path.iterdir())
