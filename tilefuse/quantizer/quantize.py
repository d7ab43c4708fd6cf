"""Dense weight -> AQLM 2x8 codes, codebooks and scales (``tilefuse.quantize``).

Objective: ``sum_n sum_g (w_ng - s_n u_ng)^T H_g (w_ng - s_n u_ng)`` with ``u_ng = C0[a_ng] + C1[b_ng]``,
``w_ng`` the g-th 8-weight group of row n, and ``H_g`` the 8x8 diagonal block of the calibration
matrix ``H = X^T X`` for that group (the identity without calibration: plain weight MSE).

Why the block diagonal: with the full ``H`` the groups of a row interact, and exact code search
becomes a joint problem over a whole row (AQLM runs a beam search over it). The 8x8 blocks keep
each group independent, so codes are chosen by a nearest-neighbour search per group, while still
weighting the directions inside a group by how strongly the layer's inputs excite them. The
cross-group terms of ``H`` are handled afterwards by error feedback (step 4; docs/vq_quality.md).

Algorithm (each step of 3 minimises the block objective exactly over its own variables, so it
never increases; step 4 is kept only where it lowers the full objective ``tr(D H D^T)``):

1. scales ``s_n`` = RMS of row n; targets ``v = w / s``;
2. residual k-means: C0 = k-means of ``v``; C1 = k-means of ``v - C0[a]`` (256 entries each);
3. ``iters`` passes of: re-assign codes (for each codebook in turn, the best code given the other;
   with ``beam > 1`` the ``beam`` best candidates are each completed by the best code of the other
   codebook and the best pair wins), refit the codebooks by least squares given the codes, refit
   each row's scale by least squares;
4. with ``calib``: GPTQ-style error feedback over the full ``H`` (``_feedback.py``), which brings
   back the cross-group terms that step 3 ignores.
"""

from __future__ import annotations

import sys
import time

import torch

from tilefuse.quantizer import _core, _feedback

GROUP = 8
ENTRIES = 256
BOOKS = 2


def _check_args(weight, calib, iters, beam, init_iters, feedback) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dimensions [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight: expected a floating-point dtype, got {weight.dtype}")
    num_rows, k = weight.shape
    if num_rows == 0 or k == 0 or k % GROUP:
        raise ValueError(f"weight: expected K (= weight.shape[1]) a positive multiple of {GROUP} and N > 0, "
                         f"got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight: expected finite values, got NaN or inf")
    if calib is not None:
        if not isinstance(calib, torch.Tensor):
            raise ValueError(f"calib: expected a torch.Tensor or None, got {type(calib).__name__}")
        if tuple(calib.shape) != (k, k):
            raise ValueError(f"calib: expected shape [K, K] = ({k}, {k}), got {tuple(calib.shape)}")
        if not torch.isfinite(calib).all():
            raise ValueError("calib: expected finite values, got NaN or inf")
    for name, value, low in (("iters", iters, 0), ("beam", beam, 1), ("init_iters", init_iters, 0),
                             ("feedback", feedback, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if beam > ENTRIES:
        raise ValueError(f"beam: expected at most {ENTRIES} candidates (the codebook size), got {beam}")


def _update_codes(v, codes, books, blocks, beam):
    """Re-assign both codes of every group given the codebooks (greedy, or beam over candidates)."""
    norms = [_core.entry_norms(books[c], blocks) for c in range(BOOKS)]
    num_rows, num_groups, _ = v.shape
    for rows in _core.row_chunks(num_rows, num_groups, ENTRIES * beam):
        vr, cr = v[rows], codes[rows]
        for c in range(BOOKS):
            o = 1 - c
            dist = _core.distances(vr - books[o][cr[..., o]], books[c], blocks, norms[c])
            if beam == 1:
                cr[..., c] = dist.argmin(-1)
                continue
            cand = dist.topk(beam, dim=-1, largest=False).indices                 # [n, G, B]
            n = cand.shape[0]
            rest = (vr.unsqueeze(2) - books[c][cand]).transpose(1, 2).reshape(n * beam, num_groups, GROUP)
            best, arg = _core.distances(rest, books[o], blocks, norms[o]).min(-1)   # [n*B, G]
            total = (best + _core.quadratic(rest, blocks)).view(n, beam, num_groups)
            pick = total.argmin(1, keepdim=True)                                    # [n, 1, G]
            cr[..., c] = cand.gather(2, pick.transpose(1, 2)).squeeze(2)
            cr[..., o] = arg.view(n, beam, num_groups).gather(1, pick).squeeze(1)
        codes[rows] = cr
    return codes


def _decode(books, codes):
    return books[0][codes[..., 0]] + books[1][codes[..., 1]]                       # [N, G, 8]


def _refit_scales(v, u, blocks, scales):
    """Per-row least-squares scale ``s = sum_g w^T H u / sum_g u^T H u`` (kept where undefined).

    Computed from the targets ``v = w / scales`` as ``scales * sum_g v^T H u / sum_g u^T H u``, so
    that no product of the weight's own magnitude is formed (no overflow for rows of 1e20)."""
    hu = _core.apply_metric(u, blocks)
    num = (v * hu).sum((1, 2))
    den = (u * hu).sum((1, 2))
    ok = den > 1e-30 * den.max().clamp_min(1e-30)
    new = torch.where(ok, scales * (num / den.clamp_min(1e-30)), scales)
    return torch.where((new.abs() > 1e-30) & torch.isfinite(new), new, scales)


def _error_feedback(w, calib, codes, books, scales, beam, rounds, log):
    """Rounds of :func:`_feedback.feedback_pass`; keeps the best state under the full ``H``."""
    num_rows = w.shape[0]
    factor = _feedback.inverse_factor(calib)

    def full(c, b):
        approx = scales[:, None, None] * _decode(b, c)
        return _feedback.full_loss(w.reshape(num_rows, -1), approx.reshape(num_rows, -1), calib)

    best = (full(codes, books), codes.clone(), books.clone())
    log("full-H objective before feedback", best[0])
    row_weight = _core.row_weights(scales)
    for r in range(rounds):
        if r:  # refit both codebooks to the corrected weights the last pass coded, under its metrics
            for _ in range(2):
                for c in (0, 1):
                    rest = targets - books[1 - c][codes[..., 1 - c]]
                    books[c] = _core.refit_book(rest, codes[..., c], row_weight, metrics, books[c])
        codes, targets, metrics = _feedback.feedback_pass(w, scales, books, codes, factor, _update_codes, beam)
        loss = full(codes, books)
        log(f"error feedback {r + 1}/{rounds} (full-H objective)", loss)
        if loss < best[0]:
            best = (loss, codes.clone(), books.clone())
    return best[1], best[2], scales


def _loss(w, u, scales, blocks):
    """Relative weighted error ``sqrt(sum (w - s u)^T H (w - s u) / sum w^T H w)``."""
    diff = w.double() - scales.double()[:, None, None] * u.double()     # float64: rows of 1e20 square to 1e40
    ref = _core.quadratic(w.double(), None if blocks is None else blocks.double()).sum()
    err = _core.quadratic(diff, None if blocks is None else blocks.double()).sum()
    return (err / ref.clamp_min(1e-300)).sqrt().item()


def quantize(weight: torch.Tensor, calib: torch.Tensor | None = None, *, iters: int = 8, beam: int = 4,
             init_iters: int = 12, feedback: int = 1, seed: int = 0, device: torch.device | str | None = None,
             progress: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a dense weight to AQLM's 2x8 format (2 bits per weight).

    Parameters
    ----------
    weight : [N, K] float (any floating dtype), K a multiple of 8.
    calib : [K, K] or None
        ``X^T X`` of the layer's inputs ``X: [tokens, K]``. When given, the error is weighted by its
        8x8 diagonal blocks (see the module docstring); otherwise plain weight MSE is minimised.
    iters : passes of (re-assign codes, refit codebooks, refit scales) after the initialisation.
    beam : candidates per codebook in the code re-assignment (1 = greedy coordinate descent).
    init_iters : Lloyd iterations of each residual k-means.
    feedback : with ``calib`` only: rounds of GPTQ-style error feedback over the full ``H`` after the
        8x8-block passes (each: re-assign codes left to right spreading each group's error over the
        later columns; between rounds the codebooks are refit to the corrected weights). The best
        result under the full objective ``tr(D H D^T)`` is kept. 0 disables it. On SmolLM2 layers
        a second round did not improve on the first, hence the default 1.
    seed : seeds the k-means initialisation; the result is deterministic for a seed on the CPU
        (on a GPU, atomic accumulations may change the last bits).
    device : where to compute; default: CUDA when available, else the CPU.
    progress : print one line per stage to stderr.

    Returns
    -------
    codes : [N, K/8, 2] uint8, on weight's device.
    codebooks : [2, 256, 1, 8] in weight's dtype.
    scales : [N, 1, 1, 1] in weight's dtype.
    ``tilefuse.ops.vq.reference.dequantize(codes, codebooks, scales)`` rebuilds the weight.
    """
    _check_args(weight, calib, iters, beam, init_iters, feedback)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_rows, k = weight.shape
    num_groups = k // GROUP
    start = time.perf_counter()

    def log(stage, loss):
        if progress:
            print(f"tilefuse.quantize [{num_rows}x{k}] {stage}: rel. error {loss:.5f} "
                  f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)

    w = weight.detach().to(dev, torch.float32).reshape(num_rows, num_groups, GROUP)
    blocks = _core.group_blocks(calib.to(dev), GROUP) if calib is not None else None
    scales = _core.row_rms(w)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    generator = torch.Generator(device=dev).manual_seed(seed)

    v = w / scales[:, None, None]
    row_weight = _core.row_weights(scales)
    book0, code0 = _core.kmeans(v, row_weight, blocks, ENTRIES, init_iters, generator)
    book1, code1 = _core.kmeans(v - book0[code0], row_weight, blocks, ENTRIES, init_iters, generator)
    books = torch.stack([book0, book1])
    codes = torch.stack([code0, code1], -1)
    log("residual k-means init", _loss(w, _decode(books, codes), scales, blocks))

    for it in range(iters):
        codes = _update_codes(v, codes, books, blocks, beam)
        if blocks is None:
            books = _core.refit_pair_joint(v, codes, row_weight, books)
        else:  # block coordinate descent: each codebook's exact refit given the other, twice
            for _ in range(2):
                books[0] = _core.refit_book(v - books[1][codes[..., 1]], codes[..., 0], row_weight, blocks, books[0])
                books[1] = _core.refit_book(v - books[0][codes[..., 0]], codes[..., 1], row_weight, blocks, books[1])
        u = _decode(books, codes)
        scales = _refit_scales(v, u, blocks, scales)
        v = w / scales[:, None, None]
        row_weight = _core.row_weights(scales)
        log(f"pass {it + 1}/{iters}", _loss(w, u, scales, blocks))

    if calib is not None and feedback:
        codes, books, scales = _error_feedback(w, calib.to(dev), codes, books, scales, beam, feedback, log)

    out_dev, dtype = weight.device, weight.dtype
    books = books.reshape(BOOKS, ENTRIES, 1, GROUP).to(out_dev, dtype)
    scales = scales.reshape(num_rows, 1, 1, 1).to(out_dev, dtype)
    # the weight is finite (checked); a row scale refit past the dtype's range (a weight with
    # entries at its dtype's largest values) would round to inf: refuse rather than return it
    if not (torch.isfinite(books).all() and torch.isfinite(scales).all()):
        raise ValueError(f"weight: the codebooks or row scales of this {dtype} weight are not finite in {dtype} "
                         f"(entries up to {weight.detach().abs().max().item():.3g}); quantize weight.float()")
    return codes.to(torch.uint8).to(out_dev), books, scales
