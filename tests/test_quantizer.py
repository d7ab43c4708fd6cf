"""tilefuse.quantize (AQLM 2x8 quantizer) and the quality-study baselines, on the CPU.

Shapes are small (a few thousand 8-groups) so the file runs in seconds; with fewer groups than
about 4 x 256 the two 256-entry codebooks could nearly memorise the weight and the comparisons
below would say nothing, hence N x K >= 128 x 128 where quality is compared.
"""

import pytest
import torch

from tilefuse.ops.vq.reference import dequantize
from tilefuse.quantizer import finetune, kmeans_vq, quantize, relative_output_error, rtn


def _weight(n, k):
    # Heavy-ish tails and row-scale spread, like trained weights (Gaussian rows scaled 0.5x..2x).
    return torch.randn(n, k) * torch.empty(n, 1).uniform_(0.5, 2.0)


def _err(w, out, gram=None):
    return relative_output_error(w, dequantize(*out, dtype=torch.float32), gram)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 40), (64, 128)])
def test_shapes_dtypes_and_roundtrip(shape, dtype):
    n, k = shape
    w = _weight(n, k).to(dtype)
    codes, books, scales = quantize(w, iters=1, beam=2, init_iters=2, progress=False)
    assert codes.shape == (n, k // 8, 2) and codes.dtype == torch.uint8
    assert books.shape == (2, 256, 1, 8) and books.dtype == dtype
    assert scales.shape == (n, 1, 1, 1) and scales.dtype == dtype
    approx = dequantize(codes, books, scales, dtype=torch.float32)
    assert torch.isfinite(approx).all()
    # Even tiny layers must be represented far better than by zero (relative error 1).
    assert relative_output_error(w, approx) < 0.6


def test_error_decreases_with_iterations_and_beats_rtn2():
    w = _weight(128, 256)
    errs = [_err(w, quantize(w, iters=it, beam=2, init_iters=6, progress=False)) for it in (0, 2, 6)]
    # Every pass minimises the objective exactly over its own variables: never worse, and the
    # refinement must buy a visible gain over the initialisation (measured ~4% relative).
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.99 * errs[0]
    # 2-bit RTN (group 128, 2.25 bits/weight) has ~0.50 relative error on Gaussian rows; the
    # 2-bit VQ ~0.31. A margin of 0.8x leaves room for seeds yet fails a broken quantizer.
    assert errs[2] < 0.8 * relative_output_error(w, rtn(w, 2))


def test_beam_not_worse_than_greedy():
    w = _weight(128, 128)
    greedy = _err(w, quantize(w, iters=3, beam=1, init_iters=4, progress=False))
    beam = _err(w, quantize(w, iters=3, beam=4, init_iters=4, progress=False))
    assert beam <= greedy * 1.001


def test_residual_init_beats_single_codebook():
    w = _weight(128, 256)
    residual = _err(w, quantize(w, iters=0, init_iters=6, progress=False))
    single = relative_output_error(w, kmeans_vq(w, dim=8, entries=256, iters=6))
    # The second (residual) codebook must remove a real share of the first one's error
    # (measured 0.26 vs 0.51).
    assert residual < 0.7 * single


def test_calibration_lowers_weighted_error():
    n, k = 128, 128
    w = _weight(n, k)
    # Inputs whose channels differ in scale by ~30x and are correlated within 8-groups.
    x = torch.randn(1024, k) @ (torch.eye(k) + 0.3 * torch.randn(k, k) / k ** 0.5)
    x = x * torch.logspace(-1, 0.5, k)[torch.randperm(k)]
    gram = x.T @ x
    plain = quantize(w, iters=3, beam=2, init_iters=6, progress=False)
    weighted = quantize(w, gram, iters=3, beam=2, init_iters=6, feedback=0, progress=False)
    # Weighted objective: calib must win clearly on it (measured 0.57x), and lose on plain MSE.
    assert _err(w, weighted, gram) < 0.75 * _err(w, plain, gram)
    assert _err(w, weighted) > _err(w, plain)


def test_deterministic_for_a_seed():
    w = _weight(32, 64)
    a = quantize(w, iters=1, init_iters=2, seed=3, progress=False)
    b = quantize(w, iters=1, init_iters=2, seed=3, progress=False)
    c = quantize(w, iters=1, init_iters=2, seed=4, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], c[1])


def test_zero_rows_and_constant_weight_stay_finite():
    w = _weight(16, 64)
    w[3] = 0
    w[5] = 1.5
    out = quantize(w, iters=2, init_iters=2, progress=False)
    approx = dequantize(*out, dtype=torch.float32)
    assert torch.isfinite(approx).all()
    assert approx[3].abs().max() < 1e-3
    torch.testing.assert_close(approx[5], w[5], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("huge", [1e20, 1e23, 1e37])
@pytest.mark.parametrize("calibrated", [False, True])
def test_huge_and_tiny_rows_stay_finite(calibrated, huge):
    """A finite weight with a row of 1e20 (its squares overflow fp32) and one of 1e-30 (its squares
    underflow): finite codebooks and scales, the huge row kept as well as the rest. From 1e23 the
    rows' weights (scale^2, 1e46) made the codebook refit's ridge overflow fp32: NaN codebooks."""
    w = _weight(64, 256)
    w[3] = huge * torch.randn(256)
    w[7] = 1e-30 * torch.randn(256)
    gram = torch.eye(256) + 0.1 if calibrated else None
    codes, books, scales = quantize(w, gram, iters=2, init_iters=4, progress=False)
    assert torch.isfinite(books).all() and torch.isfinite(scales).all()
    approx = dequantize(codes, books.double(), scales.double(), dtype=torch.float64)
    row_err = (approx - w.double()).norm(dim=1) / w.double().norm(dim=1)
    assert torch.isfinite(row_err).all()
    # the objective weighs rows by scale^2: the 1e20 row dominates and is kept almost exactly;
    # the others stay far better than zero (relative error 1)
    assert row_err[3] < 1e-3 and row_err.mean() < 0.6 and row_err[7] < 0.8


@pytest.mark.parametrize("huge", [1e20, 1e23])
def test_kmeans_baseline_with_a_huge_row_stays_finite(huge):
    """The quality-study baseline scales rows the same overflow-free way as ``quantize``."""
    w = _weight(64, 256)
    w[3] = huge * torch.randn(256)
    approx = kmeans_vq(w, iters=2)
    assert torch.isfinite(approx).all()           # before: NaN everywhere (the squares overflowed)
    row_err = (approx.double() - w.double()).norm(dim=1) / w.double().norm(dim=1)
    assert row_err.max() < 0.6


def test_progress_goes_to_stderr_by_default(capsys):
    w = _weight(8, 16)
    quantize(w, iters=2, init_iters=1)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("tilefuse.quantize [8x16]") == 3
    quantize(w, iters=2, init_iters=1, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=torch.randn(64)), "weight"),
    (dict(weight=torch.randn(4, 12)), "weight"),
    (dict(weight=torch.randint(0, 3, (4, 16))), "weight"),
    (dict(weight=torch.full((4, 16), float("nan"))), "weight"),
    (dict(weight=torch.zeros(4, 16).index_fill_(1, torch.tensor([5]), float("inf"))), "weight"),
    (dict(weight=torch.full((4, 16), float("-inf"), dtype=torch.float16)), "weight"),
    (dict(weight=torch.randn(4, 16), calib=torch.randn(8, 8)), "calib"),
    (dict(weight=torch.randn(4, 16), calib=torch.randn(16, 16).numpy()), "calib"),
    (dict(weight=torch.randn(4, 16), calib=-torch.eye(16)), "calib"),
    (dict(weight=torch.randn(4, 16), calib=torch.eye(16) - 3 * torch.ones(16, 16) / 16 + torch.diag(
        torch.linspace(0, 1, 16))), "calib"),
    (dict(weight=torch.randn(4, 16), iters=-1), "iters"),
    (dict(weight=torch.randn(4, 16), beam=0), "beam"),
    (dict(weight=torch.randn(4, 16), beam=257), "beam"),
    (dict(weight=torch.randn(4, 16), feedback=1.5), "feedback"),
])
def test_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(progress=False, **kwargs)


def test_rtn_baseline():
    w = _weight(8, 200)                     # a ragged last group of 72
    for bits, bound in ((2, 0.6), (3, 0.3), (8, 0.01)):
        err = relative_output_error(w, rtn(w, bits))
        assert err < bound
    # Values already on a 4-level grid per group are reproduced exactly at 2 bits.
    grid = torch.randint(0, 4, (4, 256)).float() * 0.25 - 0.3
    grid[:, 0], grid[:, 1], grid[:, 128], grid[:, 129] = -0.3, 0.45, -0.3, 0.45
    torch.testing.assert_close(rtn(grid, 2), grid)


def test_relative_output_error_matches_direct():
    w, approx, x = torch.randn(16, 32), torch.randn(16, 32), torch.randn(50, 32)
    direct = ((x @ (w - approx).T).norm() / (x @ w.T).norm()).item()
    assert relative_output_error(w, approx, x.T @ x) == pytest.approx(direct, rel=1e-6)
    assert relative_output_error(w, approx) == pytest.approx(((w - approx).norm() / w.norm()).item(), rel=1e-6)


def _correlated_gram(k, tokens=2048):
    # Inputs correlated across 8-groups (a shared low-rank component) with uneven channel scales.
    x = torch.randn(tokens, k) + torch.randn(tokens, 4) @ torch.randn(4, k)
    return (x * torch.logspace(-0.5, 0.5, k)).T @ (x * torch.logspace(-0.5, 0.5, k))


def test_error_feedback_lowers_full_objective():
    w = _weight(128, 128)
    # Inputs dominated by 32 directions, as real activations are (fast-decaying spectrum).
    x = torch.randn(2048, 32) @ torch.randn(32, 128) + 0.3 * torch.randn(2048, 128)
    gram = x.T @ x
    plain = quantize(w, gram, iters=2, init_iters=6, feedback=0, progress=False)
    fed = quantize(w, gram, iters=2, init_iters=6, feedback=1, progress=False)
    # GPTQ-style feedback uses the cross-group terms of H that the 8x8 blocks ignore: it pushes
    # each group's error into directions the inputs barely excite. Measured ~0.67x over seeds; a
    # no-op or a sign error in the update would not pass 0.85x.
    assert _err(w, fed, gram) < 0.85 * _err(w, plain, gram)


def test_feedback_pass_spreads_nothing_across_independent_groups():
    from tilefuse.quantizer import _feedback
    from tilefuse.quantizer.quantize import _update_codes
    n, k = 16, 32
    w = _weight(n, k)
    blocks = [torch.randn(8, 8) for _ in range(k // 8)]
    gram = torch.block_diag(*[b @ b.T + torch.eye(8) for b in blocks])
    scales = w.pow(2).mean(1).sqrt()
    books = torch.randn(2, 256, 8) * 0.5
    codes = torch.zeros(n, k // 8, 2, dtype=torch.int64)
    _, targets, metrics = _feedback.feedback_pass(w.view(n, -1, 8), scales, books, codes,
                                                  _feedback.inverse_factor(gram), _update_codes, 1)
    # Block-diagonal H: no error may leak into later groups, and each group's metric is its block
    # of the (normalised, damped) H itself.
    torch.testing.assert_close(targets, w.view(n, -1, 8) / scales[:, None, None])
    h = gram / gram.diagonal().mean() + 0.01 * torch.eye(k)
    torch.testing.assert_close(metrics[1], h[8:16, 8:16], rtol=1e-4, atol=1e-4)
    # And with a dense H, later groups' targets do move.
    dense = _correlated_gram(k)
    _, moved, _ = _feedback.feedback_pass(w.view(n, -1, 8), scales, books, codes.clone(),
                                          _feedback.inverse_factor(dense), _update_codes, 1)
    assert (moved[:, 1:] - targets[:, 1:]).abs().max() > 1e-2
    torch.testing.assert_close(moved[:, 0], targets[:, 0])


@pytest.mark.gpu
def test_quantize_on_gpu_matches_cpu_quality():
    # The same algorithm on CUDA (atomics may reorder sums, so codes can differ in the last bits):
    # its error must match the CPU run's within a few percent.
    w = _weight(256, 512)
    x = torch.randn(2048, 64) @ torch.randn(64, 512) + 0.3 * torch.randn(2048, 512)
    gram = x.T @ x
    cpu = _err(w, quantize(w, gram, iters=2, init_iters=6, device="cpu", progress=False), gram)
    out = quantize(w.cuda(), gram.cuda(), iters=2, init_iters=6, progress=False)
    assert out[0].is_cuda and out[0].dtype == torch.uint8
    gpu = _err(w, tuple(t.cpu() for t in out), gram)
    assert gpu < 1.05 * cpu


# ----------------------------------------------------------------------------- finetune
def _tiny_block():
    """A SwiGLU MLP block (hidden 64, intermediate 96) with trained-looking weights, its three
    layers quantized to 2x8 one by one, and calibration batches with the dense block's outputs."""
    gen = torch.Generator().manual_seed(3)
    dense = {name: torch.randn(n, k, generator=gen) * k ** -0.5
             for name, (n, k) in {"gate": (96, 64), "up": (96, 64), "down": (64, 96)}.items()}

    def forward(w, x):
        return x + (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T

    inputs = [torch.randn(128, 64, generator=gen) for _ in range(4)]
    targets = [forward(dense, x) for x in inputs]
    quantized = {name: quantize(w, iters=2, beam=1, init_iters=4, progress=False) for name, w in dense.items()}
    return forward, quantized, inputs, targets


def test_finetune_lowers_the_block_error_and_keeps_the_format():
    """Adam on the codebooks and scales lowers the block's output error on the calibration
    batches (deterministic on the CPU); the codes are untouched, the dtypes and shapes kept, and
    the tuned format dequantizes to the weights the loss saw."""
    forward, quantized, inputs, targets = _tiny_block()
    tuned, info = finetune(forward, quantized, inputs, targets, steps=60, lr=1e-3, progress=False)
    assert info["error_after"] < 0.9 * info["error_before"]
    weights = {name: dequantize(*fmt, dtype=torch.float32) for name, fmt in tuned.items()}
    from tilefuse.quantizer.finetune import relative_error
    assert relative_error(forward, weights, inputs, targets) == pytest.approx(info["error_after"], rel=1e-5)
    for name, (codes, books, scales) in tuned.items():
        assert torch.equal(codes, quantized[name][0])
        assert books.dtype == quantized[name][1].dtype and books.shape == quantized[name][1].shape
        assert scales.dtype == quantized[name][2].dtype and scales.shape == quantized[name][2].shape
    again, info2 = finetune(forward, quantized, inputs, targets, steps=60, lr=1e-3, progress=False)
    assert info2["error_after"] == info["error_after"]
    assert all(torch.equal(again[n][1], tuned[n][1]) for n in tuned)


def test_finetune_never_returns_a_worse_state():
    """A learning rate that diverges leaves the given codebooks and scales in place."""
    forward, quantized, inputs, targets = _tiny_block()
    tuned, info = finetune(forward, quantized, inputs, targets, steps=5, lr=50.0, progress=False)
    assert info["error_after"] == info["error_before"]
    assert all(torch.equal(tuned[n][1], quantized[n][1]) and torch.equal(tuned[n][2], quantized[n][2])
               for n in tuned)


def test_finetune_tunes_dense_tensors_in_place_under_any_objective():
    """``tune``: a dense tensor the forward reads (here an RMSNorm-like input scale, started off
    its dense value) is tuned with the codebooks and written back in place; ``objective``: the
    loss minimized and reported is the one given (an L1 error here), not the squared error."""
    forward0, quantized, inputs, targets = _tiny_block()
    gain = torch.full((64,), 0.5)                                      # the dense model has 1.0

    def forward(w, x):
        return forward0(w, x * w["gain"])

    calls = []

    def l1(out, target):
        calls.append(out.shape)
        return (out - target).abs().mean()

    start = gain.clone()
    tuned, info = finetune(forward, quantized, inputs, targets, steps=60, lr=1e-2, tune={"gain": gain}, objective=l1,
                           progress=False)
    weights = {"gain": gain, **{name: dequantize(*fmt, dtype=torch.float32) for name, fmt in tuned.items()}}
    from tilefuse.quantizer.finetune import mean_objective
    assert info["error_after"] < 0.8 * info["error_before"]
    assert mean_objective(forward, weights, inputs, targets, l1) == pytest.approx(info["error_after"], rel=1e-5)
    assert (gain - start).abs().mean() > 0.05 and gain.dtype == torch.float32
    assert len(calls) >= 60 and all(shape == (128, 64) for shape in calls)
    fixed = torch.full((64,), 0.5)
    finetune(forward, quantized, inputs, targets, steps=5, lr=50.0, tune={"gain": fixed}, objective=l1,
             progress=False)
    assert torch.equal(fixed, torch.full((64,), 0.5))                  # a worse state is not written back


def test_finetune_callback_sees_the_weights_of_every_step():
    """``callback(steps_done, weights)`` runs after each step; ``weights()`` is the current dense
    state (the tuned layers dequantized, the tuned tensors, the fixed ones), so an evaluation at a
    chosen step scores what the optimizer holds then: the errors seen along the way fall, and the
    last one is the error the returned state has."""
    from tilefuse.quantizer.finetune import relative_error
    forward, quantized, inputs, targets = _tiny_block()
    seen = []

    def callback(done, weights):
        w = weights()
        assert set(w) == set(quantized) and all(not t.requires_grad and t.dtype == torch.float32 for t in w.values())
        if done % 20 == 0:
            seen.append((done, relative_error(forward, w, inputs, targets)))

    tuned, info = finetune(forward, quantized, inputs, targets, steps=60, lr=1e-3, progress=False, callback=callback)
    assert [d for d, _ in seen] == [20, 40, 60]
    assert seen[-1][1] < seen[0][1] < info["error_before"]
    assert seen[-1][1] == pytest.approx(info["error_after"], rel=1e-6)


def test_finetune_keeps_the_state_best_on_held_out_batches():
    """``validation``: the state returned is the one with the lowest error on the given batches
    among the start and every ``check_every`` steps, not the last one (its error is the minimum of
    those the callback sees at the checked steps, ``best_step`` names that step). On a batch held
    out of this tiny block's tuning every checked state is worse than the start (three batches
    over-fit), so the given state comes back, where the tuning-error rule keeps a tuned one."""
    from tilefuse.quantizer.finetune import relative_error

    forward, quantized, inputs, targets = _tiny_block()

    def error_of(formats, batches):
        return relative_error(forward, {n: dequantize(*f, dtype=torch.float32) for n, f in formats.items()}, *batches)

    seen = {}

    def callback(done, weights):
        if done % 5 == 0:
            seen[done] = relative_error(forward, weights(), inputs, targets)

    tuned, info = finetune(forward, quantized, inputs, targets, steps=40, lr=1e-2, progress=False,
                           validation=(inputs, targets), check_every=5, callback=callback)
    best_step = min(seen, key=seen.get)
    assert info["best_step"] == best_step and info["error_after"] == pytest.approx(seen[best_step], rel=1e-6)
    assert error_of(tuned, (inputs, targets)) == pytest.approx(seen[best_step], rel=1e-5)
    assert seen[best_step] < info["error_before"]
    held = ([inputs[3]], [targets[3]])
    kept, info = finetune(forward, quantized, inputs[:3], targets[:3], steps=40, lr=1e-3, progress=False,
                          validation=held, check_every=5)
    assert info["best_step"] == 0 and all(torch.equal(kept[n][1], quantized[n][1]) for n in kept)
    last, _ = finetune(forward, quantized, inputs[:3], targets[:3], steps=40, lr=1e-3, progress=False)
    assert error_of(last, held) > error_of(kept, held)


def test_adam_cosine_schedule_moves_the_state_less_step_by_step():
    """``schedule="cosine"``: Adam's rate falls from ``lr`` to 0 over the steps, so on a quadratic
    the first step moves every coordinate by about ``lr`` (Adam's first step is ``lr`` times the
    gradient's sign) and the last by under 1 % of that, where the constant rate still moves it
    by a sizeable share; and a tiny block tuned with it still lowers its error."""
    from tilefuse.quantizer.finetune import adam_keep_best

    def moves(schedule):
        x = torch.zeros(16, requires_grad=True)
        target = torch.linspace(1.0, 2.0, 16)
        states = [x.detach().clone()]
        adam_keep_best({"x": x}, lambda step: (x - target).pow(2).sum(), 50, 0.01, lambda: 0.0, validated=False,
                       check_every=10, on_step=lambda done, loss: states.append(x.detach().clone()),
                       schedule=schedule)
        return [(b - a).abs().max().item() for a, b in zip(states, states[1:])]

    cosine, constant = moves("cosine"), moves("constant")
    assert cosine[0] == pytest.approx(0.01, rel=1e-3) and constant[0] == pytest.approx(0.01, rel=1e-3)
    assert cosine[-1] < 0.01 * cosine[0] and constant[-1] > 0.5 * constant[0]
    assert all(b <= a * 1.0001 for a, b in zip(cosine[10:], cosine[11:]))     # falling once Adam has warmed up
    forward, quantized, inputs, targets = _tiny_block()
    _, info = finetune(forward, quantized, inputs, targets, steps=60, lr=1e-3, progress=False, schedule="cosine")
    assert info["error_after"] < 0.9 * info["error_before"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantized={}), "quantized: expected a non-empty dict"),
    (dict(tune={"gate": torch.ones(3)}), r"tune\['gate'\]: expected a floating-point tensor"),
    (dict(tune={"gain": torch.ones(3, dtype=torch.int32)}), r"tune\['gain'\]"),
    (dict(objective="kl"), "objective: expected a callable"),
    (dict(callback=3), "callback: expected a callable"),
    (dict(validation=([], [])), "validation: expected"),
    (dict(check_every=0), "check_every: expected an int >= 1"),
    (dict(targets=[]), "inputs, targets: expected the same"),
    (dict(steps=-1), "steps: expected an int >= 0"),
    (dict(lr=0.0), "lr: expected a float > 0"),
    (dict(schedule="linear"), r"schedule: expected one of \('constant', 'cosine'\), got 'linear'"),
])
def test_finetune_clear_errors(kwargs, match):
    forward, quantized, inputs, targets = _tiny_block()
    args = dict(quantized=quantized, inputs=inputs, targets=targets) | kwargs
    with pytest.raises(ValueError, match=match):
        finetune(forward, args.pop("quantized"), args.pop("inputs"), args.pop("targets"), **args)
