"""The ``tilefuse`` command works on any machine (on a CPU it runs the reference path as a pipeline
check, and says nothing it did not measure)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tilefuse.bench.harness import Case, Ceilings, Timer, run_case
from tilefuse.bench.runner import FAMILIES, header, resummarize, write_results

RATIO = re.compile(r"\d+(\.\d+)?x\b|\bx\d+\.\d")    # "1.23x", "x1.23": a ratio as tables print them


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no CUDA GPU, whatever the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_info_runs(capsys):
    from tilefuse.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "kernels:" in out


def test_module_entry_point_help():
    done = subprocess.run([sys.executable, "-m", "tilefuse", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "tilefuse info" in done.stdout and "tilefuse bench" in done.stdout
    assert "``" not in done.stdout


def test_bench_help_names_every_family_and_the_defaults(capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in (*FAMILIES, "model", "all", "tp"):
        assert re.search(rf"^  {name} +\S", out, re.M), name            # a line of its own under "benchmarks:"
    words = " ".join(out.split())
    assert "``" not in out and "default: bench/results in the current folder" in words
    assert 'every "x" column is a speedup, baseline time / tilefuse time' in words


@pytest.mark.parametrize("option, value", [("--rep-ms", "-5"), ("--rep-ms", "0"), ("--rep-ms", "nan"),
                                           ("--rep-ms", "inf"), ("--layers", "0"), ("--layers", "-2"),
                                           ("--layers", "1.5"), ("--tag", "@@"), ("--contexts", "0"),
                                           ("--contexts", "4096,x"), ("--contexts", "")])
def test_numeric_options_are_validated(option, value, capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "vq", "--quick", f"{option}={value}"])
    assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_bench_functions_refuse_bad_numbers(tmp_path):
    from tilefuse.bench import runner, tp
    from tilefuse.bench import model as bench_model

    with pytest.raises(ValueError, match="rep_ms"):
        runner.main(["vq"], True, tmp_path, rep_ms=-5.0)
    with pytest.raises(ValueError, match="layers"):
        bench_model.main(out_dir=tmp_path, layers=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="contexts"):
        bench_model.main(out_dir=tmp_path, contexts=(4096, 0), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="layers"):
        tp.run(True, tmp_path, layers=-1)
    assert not list(tmp_path.iterdir())


def closed_reader(args: list[str], unbuffered: bool) -> subprocess.CompletedProcess:
    """Run ``python -m tilefuse ARGS`` with its stdout a pipe whose reader is gone before it writes
    (and no GPU in sight, so that a bench is the quick pipeline check on any machine)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1" if unbuffered else "", CUDA_VISIBLE_DEVICES="")
    child = subprocess.Popen([sys.executable, "-m", "tilefuse", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    child.stdout.close()                          # like `| head -0`: gone before the first line
    err = child.stderr.read()
    return subprocess.CompletedProcess(args, child.wait(timeout=300), None, err)


@pytest.mark.parametrize("unbuffered", [False, True])
def test_info_survives_a_closed_pipe(unbuffered):
    done = closed_reader(["info"], unbuffered)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_bench_survives_a_closed_pipe_and_still_writes_its_results(tmp_path):
    done = closed_reader(["bench", "vq", "--quick", "--only", '"tokens": 8', "--out", str(tmp_path)], True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


def test_bad_family_is_rejected(capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err


def test_run_case_rows_and_json_shape(tmp_path, capsys):
    """On a CPU every implementation is called once and nothing is timed (no times, no rates); a
    failing call is an error row; the file says it is a pipeline check, with no ceilings."""
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
    assert rows[0]["rel_err"] == 0.0 and len(calls) == 1
    assert rows[0]["flops"] == 2 * 64 ** 3 and rows[0]["bytes"] == 3 * 64 * 64 * 4
    for key in ("gpu_us", "eager_us", "graph_us", "tflops", "roofline_frac", "median_us", "best_us", "host_us"):
        assert key not in rows[0]
    assert "ZeroDivisionError" in rows[2]["error"]
    head = header(torch.device("cpu"), Ceilings(None, None), timer)
    assert head["timing"]["mode"] == "cpu-pipeline-check" and "nothing timed" in head["timing"]["note"]
    assert set(head["machine"]) >= {"gpu", "torch", "triton", "date", "env", "config_overrides"}
    path = write_results("toy", rows, head, tmp_path)
    data = json.loads(path.read_text())
    assert set(data) == {"machine", "ceilings", "timing", "rows", "incomplete"}
    assert data["ceilings"] == {"copy_gbps": None, "gemm_bf16_tflops": None}
    write_results("toy", rows, head, tmp_path, summary={"pipeline_check": {}})
    assert not path.with_suffix(".png").exists()    # a CPU run draws no plot


def test_only_runs_are_tagged_and_saved_case_by_case(tmp_path, monkeypatch, no_gpu, capsys):
    """A --only run writes <family>-<gpu>-only.json (never the full run's file), and the rows are
    saved after every case, so a run cut short by a timeout still leaves them; stdout is the
    family's one line (a CPU run)."""
    from tilefuse.bench import runner

    saved = []
    real_write = runner.write_results

    def spy(family, rows, head, out_dir, summary=None, **kwargs):
        saved.append((len(rows), kwargs.get("tag"), summary is not None))
        return real_write(family, rows, head, out_dir, summary, **kwargs)

    monkeypatch.setattr(runner, "write_results", spy)
    assert runner.main(["vq"], quick=True, out_dir=tmp_path, only='"tokens": 8', rep_ms=1.0) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("vq-cpu-") and files[0].endswith("-quick-only.json"), files
    partial = [s for s in saved if not s[2]]
    assert len(partial) == 2 and all(tag == "only" for _, tag, _ in saved) and saved[-1][2]
    assert [n for n, _, _ in partial] == sorted(n for n, _, _ in partial)  # rows grow case by case
    out = capsys.readouterr().out
    assert out == "vq: pipeline check: 2 cases ran on the reference path, nothing timed\n"
    summary = json.loads((tmp_path / files[0]).read_text())["summary"]
    assert summary == {"pipeline_check": {"cases": 2, "calls": 4, "failed": []}}
    assert runner.result_path("mla", {"gpu": "NVIDIA H200"}, tmp_path, tag="h16s1").name == "mla-h200-h16s1.json"


def test_only_matching_nothing_writes_nothing(tmp_path, capsys):
    from tilefuse.cli import main

    assert main(["bench", "swiglu", "--only", "no-such-case", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "no-such-case" in err and "swiglu" in err
    assert not list(tmp_path.iterdir())


def test_cpu_main_job_prints_no_ratio_and_names_every_family(tmp_path, no_gpu, capsys):
    """`tilefuse bench all --quick` without a GPU: one line per family (a pipeline check, or why it
    did not run), no speedup, ceiling or goal verdict anywhere, no plot, and exit status 0."""
    pytest.importorskip("transformers")
    from tilefuse.cli import main

    assert main(["bench", "all", "--quick", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    for family in (*FAMILIES, "model"):
        mine = [line for line in lines if line.startswith(f"{family}: ")]
        assert len(mine) == 1, (family, lines)
        ran = rf"{family}: pipeline check: \d+ cases? ran on the reference path, nothing timed"
        assert re.fullmatch(ran, mine[0]) or mine[0].startswith(f"{family}: not run: "), mine[0]
    assert "swiglu_fp8: not run: " in captured.out and any(line.startswith("tp: not run") for line in lines)
    for text in (captured.out, captured.err):
        assert not RATIO.search(text), RATIO.search(text)
        for word in ("ceilings", "GB/s", "TFLOP/s", "[ok]", "FAIL", "not measured", "goal"):
            assert word not in text, word
    assert not list(tmp_path.glob("*.png"))
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 4          # swiglu, mla, vq, model
    for path in files:
        data = json.loads(path.read_text())
        assert data["timing"]["mode"] == "cpu-pipeline-check" and data["summary"]["pipeline_check"]["failed"] == []
        keys = {k for r in data["rows"] for k in r}
        assert not [k for k in keys if k.endswith(("_us", "speedup")) or k in ("x_stock", "ms_per_token")], keys
    with pytest.raises(ValueError, match="nothing was timed"):
        resummarize(next(tmp_path.glob("vq-*.json")))


def test_a_family_with_no_case_here_says_so_and_fails(tmp_path, no_gpu, capsys):
    from tilefuse.cli import main

    assert main(["bench", "swiglu_fp8", "--quick", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("swiglu_fp8: not run: ") and "sm_90" in out
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- tilefuse tune's arguments
@pytest.fixture
def tune_cache(tmp_path, monkeypatch):
    """A private XDG cache folder for ``tilefuse tune`` and the dispatch's caches cleared around the test."""
    from tilefuse import _dispatch
    from tilefuse.ops.swiglu import configs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _dispatch.reload_tuned()
    yield tmp_path / "tilefuse" / "tuned-cpu.json"
    monkeypatch.undo()
    _dispatch.reload_tuned()
    configs.decide.cache_clear()


def test_tune_tp_shards_explicit_shapes(tune_cache, no_gpu, capsys):
    from tilefuse.cli import main

    assert main(["tune", "--shapes", "64x32", "--tp", "1,2", "--tokens", "1"]) == 0
    assert set(json.loads(tune_cache.read_text())["tuned"]["swiglu"]) == {"64,32", "64,16"}


@pytest.mark.parametrize("argv,shape", [
    (["--shapes", "64x32", "--tp", "3"], "--shapes 64x32"),           # 32 / 3
    (["--shapes", "64x32,64x64", "--tp", "8"], "--shapes 64x32"),     # 32 / 8 = 4: not a multiple of 8
    (["--model-type", "deepseek-v3", "--tp", "1,3"], "--model-type deepseek-v3"),
])
def test_tune_tp_that_does_not_divide_is_an_error(argv, shape, tune_cache, no_gpu, capsys):
    from tilefuse.cli import main

    assert main(["tune", *argv, "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tilefuse tune: --tp: ") and shape in err and "\n" not in err
    assert not tune_cache.exists()


def test_tune_config_errors_name_the_option_and_the_file(tmp_path, tune_cache, no_gpu, capsys):
    from tilefuse.cli import main

    bad_json, not_object, no_hidden = tmp_path / "bad.json", tmp_path / "list.json", tmp_path / "nohidden.json"
    bad_json.write_text("{'hidden_size': 8}")
    not_object.write_text("[1, 2]")
    no_hidden.write_text('{"intermediate_size": 64}')
    for path, what in ((tmp_path / "missing.json", "cannot read"), (bad_json, "not valid JSON"),
                       (not_object, "expected a JSON object"), (no_hidden, "hidden_size")):
        assert main(["tune", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err                                   # one line, no traceback
        assert err.startswith("tilefuse tune: --config: ") and str(path) in err and what in err, err
    assert not tune_cache.exists()


def test_tune_errors_say_the_prefix_once(tune_cache, no_gpu, capsys):
    from tilefuse.cli import main

    assert main(["tune"]) == 2
    err = capsys.readouterr().err
    assert err.count("tilefuse tune:") == 1 and "--model-type" in err and "--shapes" in err


# ----------------------------------------------------------------------------- layering
def _tilefuse_imports(path) -> set[str]:
    """The tilefuse modules a file imports, at module level or inside functions."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= ({f"{node.module}.{a.name}" for a in node.names} if node.module in ("tilefuse", "tilefuse.bench")
                      else {node.module})
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("tilefuse")}


def test_modules_import_downward_only():
    """The command line imports the benchmarks, never the reverse, and no two benchmark modules
    import each other (bench tp and its end-to-end part did; both imported what the other defined)."""
    from pathlib import Path

    import tilefuse

    package = Path(tilefuse.__file__).parent
    bench = {f"tilefuse.bench.{p.stem}": _tilefuse_imports(p) for p in (package / "bench").glob("*.py")}
    upward = {m: sorted(d for d in deps if d == "tilefuse.cli" or d.startswith("tilefuse.cli."))
              for m, deps in bench.items()}
    assert not any(upward.values()), f"bench modules import the command line: {upward}"
    assert _tilefuse_imports(package / "_cmdline.py") == set()

    def cycle(start, at, path):
        for dep in bench.get(at, ()):
            if dep == start:
                return path + [dep]
            if dep in bench and dep not in path:
                found = cycle(start, dep, path + [dep])
                if found:
                    return found
        return None

    cycles = [c for c in (cycle(m, m, [m]) for m in bench) if c]
    assert not cycles, f"benchmark modules import each other: {cycles[0]}"
