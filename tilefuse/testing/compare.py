"""Comparisons against an fp64 reference.

* :func:`rel_err`      -- ``||out - ref|| / ||ref||`` in fp64, the usual GEMM-level measure.
* :func:`cos_diff`     -- FlashMLA's ``1 - 2 sum(x y) / sum(x^2 + y^2)``; 0 for equal tensors.
* :func:`ulp`          -- the spacing of a float format at each value of a tensor.
* :func:`frac_beyond_ulp` -- fraction of outputs more than ``n`` ulp of their own format away
  from the fp64 reference (the SwiGLU paper's accuracy measure).
* :func:`poisoned`     -- a NaN-filled output buffer, so unwritten elements fail every check.
* :func:`assert_close` -- elementwise ``|out - ref| <= atol + rtol |ref|`` that prints where.
"""

from __future__ import annotations

import torch

# Mantissa bits (excluding the implicit one) and smallest normal exponent of each format.
_FORMATS = {
    torch.float16: (10, -14),
    torch.bfloat16: (7, -126),
    torch.float32: (23, -126),
}


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against ``ref`` (NaN anywhere gives NaN)."""
    out, ref = _f64(out), _f64(ref).to(out.device)
    denom = ref.norm()
    return float((out - ref).norm() / (denom if denom > 0 else 1.0))


def cos_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """FlashMLA's ``cos_diff = 1 - 2 sum(x y) / sum(x^2 + y^2)`` in fp64 (0 for equal tensors)."""
    x, y = _f64(out), _f64(ref).to(out.device)
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at each of ``values`` (fp64), subnormals included."""
    mantissa_bits, min_exp = _FORMATS[dtype]
    mag = _f64(values).abs()
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0 ** min_exp))).clamp_min(min_exp)
    return torch.exp2(exponent - mantissa_bits)


def frac_beyond_ulp(out: torch.Tensor, ref: torch.Tensor, n: float = 1.0) -> float:
    """Fraction of elements of ``out`` more than ``n`` ulp (of ``out.dtype``) from fp64 ``ref``.

    A correctly rounded result is within 0.5 ulp, so a single final rounding after exact
    arithmetic never exceeds 1 ulp; NaN counts as beyond.
    """
    diff = (_f64(out) - _f64(ref).to(out.device)).abs()
    beyond = ~(diff <= n * ulp(ref.to(out.device), out.dtype))
    return float(beyond.double().mean()) if out.numel() else 0.0


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN (integer dtypes: their minimum value)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float, name: str = "out",
                 max_report: int = 5) -> None:
    """Elementwise ``|out - ref| <= atol + rtol |ref|``; on failure name the worst indices."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = _f64(out), _f64(ref).to(out.device)
    same_inf = torch.isinf(o) & torch.isinf(r) & (torch.sign(o) == torch.sign(r))
    bad = ~((o - r).abs() <= atol + rtol * r.abs()) & ~same_inf
    if bad.any():
        idx = bad.nonzero()[:max_report].tolist()
        worst = ", ".join(f"{tuple(i)}: {o[tuple(i)].item():.6g} vs {r[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {o.numel()} elements off (atol={atol}, rtol={rtol}, "
            f"rel_err={rel_err(out, ref):.3g}); first: {worst}"
        )


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """Elementwise ``|out - ref| <= bound`` (fp64), every output finite (NaN-poisoned outputs left
    unwritten show); on failure name the count, the first output off, its reference and bound."""
    assert torch.isfinite(out).all(), f"{what}kernel left unwritten (NaN) or non-finite outputs"
    err = (out.double() - ref).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}{int(bad.sum())} of {out.numel()} outputs off; first {i}: "
                             f"{out[i].item():.6g} vs {ref[i].item():.6g} (bound {bound[i].item():.3g})")


def run_without_host_sync(fn):
    """``fn()`` with CUDA's sync debug mode set to "error": any host synchronization inside (a
    ``.item()``, a ``nonzero``, a device-to-host copy) raises instead of passing unnoticed.
    Returns ``fn()``'s result."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def captured(call):
    """``(graph, outputs)``: ``call()`` run once on a side stream (compiling its kernels outside the
    capture), then captured into a CUDA graph whose ``outputs`` are ``call()``'s result; replay the
    graph after changing the inputs in place."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs


def repeats_and_replays_identical(call, repeats: int = 3) -> torch.Tensor:
    """Run ``call()`` (a CUDA op returning one tensor) ``repeats`` more times eagerly and as a CUDA
    graph captured on a side stream and replayed ``repeats`` times; assert every result equals the
    first call's bit for bit (a kernel without atomics or order-dependent sums). Returns the first."""
    first = call()
    for _ in range(repeats):
        assert torch.equal(call(), first), "an eager repeat differs from the first call"
    static = {}
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()                                    # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            static["out"] = call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(repeats):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["out"], first), "a graph replay differs from the first call"
    return first
