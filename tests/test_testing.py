"""The comparison helpers the other tests rely on must themselves catch errors."""

import math

import pytest
import torch

from tilefuse.testing import assert_close, cos_diff, frac_beyond_ulp, poisoned, rel_err, ulp


@pytest.mark.parametrize("dtype, eps", [(torch.float16, 2.0 ** -10), (torch.bfloat16, 2.0 ** -7),
                                        (torch.float32, 2.0 ** -23)])
def test_ulp_matches_nextafter(dtype, eps):
    values = torch.tensor([1.0, 1.5, 3.0, -0.3, 1000.0, 1e-30], dtype=torch.float64).to(dtype)
    magnitude = values.abs()
    expected = torch.nextafter(magnitude, torch.tensor(math.inf, dtype=dtype)).double() - magnitude.double()
    assert torch.equal(ulp(values.double(), dtype), expected)
    assert ulp(torch.tensor([1.0]), dtype).item() == eps


def test_frac_beyond_ulp_counts_rounding_correctly():
    ref = torch.randn(10_000, dtype=torch.float64)
    rounded = ref.to(torch.bfloat16)
    assert frac_beyond_ulp(rounded, ref) == 0.0            # one correct rounding: <= 0.5 ulp
    nudged = (rounded.double() + 2.5 * ulp(ref, torch.bfloat16)).to(torch.bfloat16)
    assert frac_beyond_ulp(nudged, ref) > 0.99
    with_nan = rounded.clone()
    with_nan[7] = float("nan")
    assert frac_beyond_ulp(with_nan, ref) == pytest.approx(1e-4)


def test_rel_err_and_cos_diff():
    ref = torch.randn(64, 64, dtype=torch.float64)
    assert rel_err(ref, ref) == 0.0 and cos_diff(ref, ref) == pytest.approx(0.0, abs=1e-15)
    noisy = ref + 1e-3 * torch.randn_like(ref)
    assert 5e-4 < rel_err(noisy, ref) < 2e-3
    assert 0 < cos_diff(noisy, ref) < 1e-5
    assert math.isnan(rel_err(poisoned(ref.shape, torch.float32, "cpu"), ref))
    assert cos_diff(-ref, ref) == pytest.approx(2.0)


def test_assert_close_reports_indices_and_nan():
    ref = torch.ones(3, 4)
    out = ref.clone()
    assert_close(out, ref, atol=0, rtol=0)
    out[1, 2] = 2.0
    with pytest.raises(AssertionError, match=r"1 of 12 elements off.*\(1, 2\): 2 vs 1"):
        assert_close(out, ref, atol=1e-3, rtol=1e-3)
    with pytest.raises(AssertionError, match="elements off"):
        assert_close(poisoned((3, 4), torch.float16, "cpu"), ref, atol=1.0, rtol=1.0)
    inf = torch.tensor([math.inf, 1.0])
    assert_close(inf, inf.clone(), atol=0, rtol=0)   # matching infinities (lse of empty rows) pass
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([-math.inf, 1.0]), inf, atol=0, rtol=0)


def test_assert_within_names_the_first_output_off():
    """``assert_within``: passes inside the bound, fails outside it naming the count, the first
    index, its reference and bound, and fails on a NaN (an output the kernel left poisoned)."""
    from tilefuse.testing import assert_within

    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    bound = torch.full_like(ref, 0.1)
    assert_within(ref.float() + 0.05, ref, bound)
    with pytest.raises(AssertionError, match=r"case: 1 of 4 outputs off; first \(1, 0\): 3\.2 vs 3 \(bound 0\.1\)"):
        assert_within(ref.float() + torch.tensor([[0.0, 0.0], [0.2, 0.0]]), ref, bound, "case: ")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_within(torch.tensor([[1.0, float("nan")], [3.0, 4.0]]), ref, bound)


@pytest.mark.gpu
def test_captured_replays_the_call_on_new_inputs():
    from tilefuse.testing import captured

    x = torch.ones(8, device="cuda")
    graph, y = captured(lambda: x * 2 + 1)
    x.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((8,), 11.0, device="cuda"))
