"""The ``tilefuse`` command works on any machine (on a CPU it benchmarks the reference path)."""

import json
import subprocess
import sys

import pytest

from tilefuse.bench.harness import Case, Ceilings, Timer, run_case
from tilefuse.bench.runner import print_table, write_results


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
    import torch

    calls = []

    def setup():
        x = torch.randn(64, 64)
        return {"tilefuse": lambda: calls.append(1) or x @ x, "torch_eager": lambda: x @ x,
                "broken": lambda: 1 / 0}

    case = Case(params={"n": 64, "dtype": "float32"}, flops=2 * 64 ** 3, bytes=3 * 64 * 64 * 4, setup=setup,
                extras=lambda impls: {"tilefuse": {"rel_err": 0.0}})
    rows = run_case(case, "toy", Timer(torch.device("cpu"), rep_ms=5), Ceilings(100.0, 1.0))
    assert [r["impl"] for r in rows] == ["tilefuse", "torch_eager", "broken"]
    assert rows[0]["median_us"] > 0 and rows[0]["rel_err"] == 0.0 and calls
    assert rows[0]["roofline_frac"] > 0
    assert rows[2]["median_us"] is None and "ZeroDivisionError" in rows[2]["error"]
    machine = {"gpu": "cpu (test)", "torch": torch.__version__, "triton": "-", "date": "today"}
    path = write_results("toy", rows, machine, Ceilings(1.0, 2.0), tmp_path)
    data = json.loads(path.read_text())
    assert set(data) >= {"machine", "ceilings", "rows"}
    assert set(data["ceilings"]) == {"copy_gbps", "gemm_bf16_tflops"}
    assert {"family", "impl", "params", "median_us", "tflops", "gbps"} <= set(data["rows"][0])
    print_table(rows)
    assert "torch_eager" in capsys.readouterr().out
    if path.with_suffix(".png").exists() is False:
        pytest.importorskip("matplotlib")
        raise AssertionError("matplotlib is importable but no plot was written")


def test_only_runs_are_tagged_and_saved_case_by_case(tmp_path, monkeypatch):
    """A --only run writes <family>-<gpu>-only.json (never the full run's file), and the rows are
    saved after every case, so a run cut short by a timeout still leaves them."""
    from tilefuse.bench import runner

    saved = []
    real_write = runner.write_results

    def spy(family, rows, *args, **kwargs):
        saved.append((len(rows), kwargs.get("tag"), kwargs.get("plot", True)))
        return real_write(family, rows, *args, **kwargs)

    monkeypatch.setattr(runner, "write_results", spy)
    monkeypatch.setattr(runner, "measure_ceilings", lambda device, quick: Ceilings(100.0, 1.0))
    assert runner.main(["vq"], quick=True, out_dir=tmp_path, only='"tokens": 8', rep_ms=1.0) == 0
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files and all(name.endswith("-only.json") for name in files), files
    partial = [s for s in saved if s[2] is False]
    assert len(partial) >= 2 and all(tag == "only" for _, tag, _ in saved)
    assert [n for n, _, _ in partial] == sorted(n for n, _, _ in partial)  # rows grow case by case
    assert runner.result_path("mla", {"gpu": "NVIDIA H200"}, tmp_path, tag="h16s1").name == "mla-h200-h16s1.json"
