"""Helpers shared by the tests and the benchmark: fp64 comparisons, tolerances, NaN poisoning.

Per-family input builders live beside them (``tilefuse.testing.swiglu`` etc.), so the tests and
``tilefuse bench`` draw the same cases.
"""

from tilefuse.testing.compare import (  # noqa: F401
    assert_close,
    assert_within,
    captured,
    cos_diff,
    frac_beyond_ulp,
    poisoned,
    rel_err,
    repeats_and_replays_identical,
    run_without_host_sync,
    ulp,
)
