"""``tilefuse.testing.stress`` (``tilefuse stress``): the harness on the CPU (comparison, counting,
variant enumeration, the command line), and on a GPU the quick stress of every group, which must
find no wrong output."""

import itertools
import json
import threading

import pytest
import torch

from tilefuse._registry import FAMILIES
from tilefuse.testing import stress


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_matches_is_bitwise_or_within_one_output_ulp():
    a = torch.randn(64, 32).to(torch.bfloat16)
    flipped = a.clone()
    flipped.view(torch.int16)[3, 5] ^= 1                       # one ulp at one element
    assert stress.matches(a, a.clone()) and stress.matches((a, a), (a.clone(), a.clone()))
    assert not stress.matches(flipped, a)                      # exact: any bit
    assert stress.matches(flipped, a, exact_=False)            # tolerant: an ulp is fine
    far = a.clone()
    far[7, 1] += 1.0
    assert not stress.matches(far, a, exact_=False) and stress.difference(far, a) >= 0.5
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert not stress.matches(nan, a, exact_=False) and stress.difference(nan, a) == float("inf")
    assert stress.matches(nan, nan.clone())                    # NaN where the call alone has it
    zero = torch.zeros(4)
    assert not stress.matches(-zero, zero)                     # -0.0 is other bits
    assert not stress.matches((a, a), (a,)) and not stress.matches(a.float(), a)
    assert stress.difference((a, a), (a,)) == float("inf") and stress.difference(a[:2], a) == float("inf")
    ints = torch.arange(5, dtype=torch.int32)
    other_ints = ints.clone()
    other_ints[2] = 7
    assert not stress.matches(other_ints, ints, exact_=False) and stress.difference(other_ints, ints) == float("inf")
    assert stress.matches(torch.empty(0, 4), torch.empty(0, 4))
    e4m3 = torch.randn(16).to(torch.float8_e4m3fn)
    other = e4m3.clone()
    other.view(torch.uint8)[2] ^= 1
    assert stress.matches((e4m3, a), (e4m3.clone(), a)) and not stress.matches((other, a), (e4m3, a))


def _planted(bad_call: int, mode_calls: list):
    """Two cases on the CPU; the second returns a wrong output on its ``bad_call``-th call (all
    calls counted across threads) and records which call each was."""
    x, y = torch.randn(8, 8), torch.randn(3, 5)
    counter, lock = itertools.count(), threading.Lock()

    def second():
        with lock:
            n = next(counter)
        mode_calls.append(n)
        return y + 1 if n == bad_call else y.clone()

    return [stress.Case("x", lambda: x * 2), stress.Case("y", second)]


@pytest.mark.parametrize("mode,bad_call,compared", [("streams", 3, 24), ("threads", 3, 24), ("after", 1, 2)])
def test_a_planted_wrong_output_is_counted_once(mode, bad_call, compared):
    """Call 0 of the second case is its alone run (the expected output); ``bad_call`` falls in
    ``mode``. Compared: 3 rounds x 2 pairs ((x, x), (x, y)) x 2 reps x 2 sides, or each case once."""
    calls = []
    rows = stress.run_variant("swiglu", "default", _planted(bad_call, calls), "cpu", iters=3, reps=2, modes=(mode,))
    (row,) = rows
    assert bad_call in calls
    assert (row.calls, row.wrong, row.status) == (compared, 1, "wrong") and row.max_err == pytest.approx(1.0, abs=1e-5)
    assert stress.failed(rows) == rows
    assert f"{mode}: 1 wrong, max |diff| 1" in stress.format_rows(rows)


def test_refusals_errors_and_skips_are_reported_never_dropped():
    x = torch.randn(4)

    def refuse():
        raise ValueError("x: expected a multiple of 8, got 4")

    rows = stress.run_variant("vq", "mma", [stress.Case("bad", refuse), stress.Case("good", lambda: x + 1)], "cpu",
                              iters=1, reps=1, modes=("streams", "graphs"))
    assert [r.status for r in rows] == ["ok", "skipped"]
    assert "refused bad: x: expected a multiple of 8" in rows[0].reason and rows[0].cases == ["good"]
    assert "CUDA" in rows[1].reason
    rows = stress.run_variant("vq", "mma", [stress.Case("bad", refuse)], "cpu", iters=1, reps=1)
    assert all(r.status == "skipped" and "refused bad" in r.reason for r in rows) and not stress.failed(rows)
    state = {"n": 0}

    def breaks():
        state["n"] += 1
        if state["n"] > 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return x

    rows = stress.run_variant("vq", "mma", [stress.Case("breaks", breaks)], "cpu", iters=1, reps=1,
                              modes=("threads",))
    assert rows[0].status == "error" and "illegal memory access" in rows[0].reason and stress.failed(rows) == rows

    def fails_alone():
        raise RuntimeError("PassManager::run failed")

    rows = stress.run_variant("vq", "mma", [stress.Case("x", lambda: x), stress.Case("bad", fails_alone)], "cpu",
                              iters=1, reps=1)
    assert all(r.status == "error" and "bad alone: RuntimeError" in r.reason for r in rows)
    assert stress.failed(rows) == rows


def test_every_registered_variant_is_enumerated_and_reported(no_gpu):
    """Each family has a group, each group lists ``default`` and its family's every variant (the
    registry's, so a new variant is stressed without an edit here), and without a GPU every row is
    reported as skipped with its reason."""
    assert set(stress.GROUPS.values()) == set(FAMILIES)
    for group, family in stress.GROUPS.items():
        listed = stress.variants(group)
        assert listed[0] == "default" and set(FAMILIES[family].variants) <= set(listed), group
        assert len(set(listed)) == len(listed)
    assert {"mla", "mla_fp8", "mla_sparse"} <= set(stress.GROUPS)
    assert "unfused" in stress.variants("swiglu") and "unfused" in stress.variants("swiglu_fp8")
    assert "dequant" in stress.variants("vq")
    rows = stress.run(quick=True)
    assert {(r.group, r.variant) for r in rows} == {(g, v) for g in stress.GROUPS for v in stress.variants(g)}
    assert len(rows) == len(stress.MODES) * sum(len(stress.variants(g)) for g in stress.GROUPS)
    assert all(r.status == "skipped" and r.reason for r in rows)


@pytest.mark.parametrize("group", list(stress.GROUPS))
def test_every_group_runs_through_the_harness_on_the_reference_path(group):
    """The groups' real cases (quick), on the CPU's reference path, through every mode a CPU has:
    the inputs build, each call's outputs are compared, none is wrong (the reference is
    deterministic)."""
    cases = stress.cases(group, "cpu", quick=True)
    assert len(cases) >= 2                                 # a pair of one shape and a pair of two
    rows = stress.run_variant(group, "default", cases, "cpu", iters=1, reps=1,
                              modes=("streams", "threads", "after"))
    assert [(r.status, r.wrong) for r in rows] == [("ok", 0)] * 3, [stress.format_rows(rows)]
    n = len(cases)         # pairs(n): n pairs of two calls side by side; after: each call once
    assert [r.calls for r in rows] == [2 * n, 2 * n, n] and rows[0].cases == [c.name for c in cases]


def test_tolerant_variants_are_the_atomic_split_k_ones():
    assert not stress.exact("vq", "decode") and not stress.exact("vq", "default") and not stress.exact("vq", "prefill")
    assert stress.exact("vq", "dequant") and stress.exact("swiglu", "small_m") and stress.exact("mla_sparse", "default")
    assert all(group in stress.GROUPS and variant in stress.variants(group) for group, variant in stress.INEXACT)


def test_pairs_put_each_case_beside_itself_and_the_next():
    assert stress.pairs(1) == [(0, 0)]
    assert stress.pairs(3) == [(0, 0), (0, 1), (1, 2)]
    with pytest.raises(ValueError, match="group: expected one of"):
        stress.cases("nope", "cpu")


def test_command_writes_every_row_and_fails_when_nothing_ran(no_gpu, tmp_path, capsys):
    from tilefuse.cli import main

    out = tmp_path / "sub" / "stress.json"
    assert main(["stress", "--quick", "--group", "vq", "--group", "mla_sparse", "--out", str(out)]) == 1
    printed = capsys.readouterr()
    assert "nothing ran here" in printed.err
    assert "vq          decode        skipped: needs a CUDA GPU" in printed.out
    data = json.loads(out.read_text())
    assert data["quick"] and data["wrong"] == 0 and data["gpu"] is None
    assert {(r["group"], r["variant"]) for r in data["rows"]} == {
        (g, v) for g in ("vq", "mla_sparse") for v in stress.variants(g)}
    assert main(["stress", "--group", "swiglu", "--variant", "unfused", "--variant", "default", "--out", str(out)]) == 1
    assert {(r["group"], r["variant"]) for r in json.loads(out.read_text())["rows"]} == {
        ("swiglu", "unfused"), ("swiglu", "default")}


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--reps", "-1"], ["--iters", "1.5"], ["--group", "nope"],
                                  ["--quick", "extra"]])
def test_command_refuses_bad_options(argv, capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["stress", *argv])
    assert exit_.value.code == 2


def test_command_refuses_an_unknown_variant(capsys):
    from tilefuse.cli import main

    assert main(["stress", "--group", "vq", "--variant", "small_m"]) == 2     # swiglu's, not vq's
    assert "--variant: expected names from" in capsys.readouterr().err


def test_module_entry_point_has_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tilefuse", "stress", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--quick" in done.stdout and "--out" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("group", list(stress.GROUPS))
def test_gpu_quick_stress_finds_no_wrong_output(group):
    """The quick stress of ``group`` (every variant, every mode): no wrong output, no error, and
    the default dispatch ran in every mode."""
    rows = stress.run((group,), quick=True)
    table = "\n".join(stress.format_rows([r for r in rows if r.variant == v]) for v in stress.variants(group))
    assert not stress.failed(rows), table
    assert all(r.status == "ok" and r.calls for r in rows if r.variant == "default"), table
