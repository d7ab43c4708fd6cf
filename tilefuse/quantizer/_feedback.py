"""GPTQ-style error feedback for vector codes: uses the full calibration matrix ``H = X^T X``.

The 8x8-block objective of the main loop ignores how the groups of a row interact through ``H``.
This pass restores those terms the way GPTQ does for scalars (and GPTVQ for vectors): walk the
8-column groups left to right; choose the codes of group ``S`` for the *current* (already
corrected) weights under the metric ``[(H_F^-1)_SS]^-1`` (F = groups not yet fixed), then move
the quantization error of ``S`` onto the later columns, ``W_R -= (W_S - Q_S) U_SS^-1 U_SR``, where
``H^-1 = U^T U`` (upper Cholesky factor). Codebooks and scales stay fixed during a pass; the
corrected weights it saw are returned as targets for refitting them.
"""

from __future__ import annotations

import torch


def inverse_factor(calib: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float64), H normalised."""
    h = calib.to(torch.float64)
    h = (h + h.T) / 2
    h = h / h.diagonal().mean()
    h += damp * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    chol, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise ValueError("calib: expected a positive semi-definite X^T X, got a matrix that stays "
                         "indefinite after 1% damping")
    return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)


def feedback_pass(w: torch.Tensor, scales: torch.Tensor, books: torch.Tensor, codes: torch.Tensor,
                  factor: torch.Tensor, update_codes, beam: int):
    """One left-to-right pass. w: [N, G, d]; codes [N, G, 2] (start point, updated in place).

    Returns (codes, targets ``[N, G, d]`` = the corrected weights each group was coded for,
    divided by the row scales, and the per-group metrics ``[G, d, d]`` used).
    """
    num_rows, num_groups, d = w.shape
    work = w.reshape(num_rows, -1).to(torch.float64).clone()
    u = factor
    metrics = torch.empty(num_groups, d, d, dtype=torch.float32, device=w.device)
    targets = torch.empty_like(w)
    inv_s = (1.0 / scales.to(torch.float64))[:, None]
    for g in range(num_groups):
        cols = slice(g * d, (g + 1) * d)
        u_ss = u[cols, cols]
        metric = torch.linalg.inv(u_ss.T @ u_ss)
        metric = ((metric + metric.T) / 2).to(torch.float32)
        metrics[g] = metric
        target = (work[:, cols] * inv_s).to(torch.float32)
        targets[:, g] = target
        update_codes(target[:, None, :], codes[:, g:g + 1], books, metric[None], beam)
        quant = (books[0][codes[:, g, 0]] + books[1][codes[:, g, 1]]).double() / inv_s
        if (g + 1) * d < work.shape[1]:
            # err = (W_S - Q_S) U_SS^-1, spread over the later columns through U's row block.
            err = torch.linalg.solve_triangular(u_ss, work[:, cols] - quant, upper=True, left=False)
            work[:, (g + 1) * d:] -= err @ u[cols, (g + 1) * d:]
    return codes, targets, metrics


def full_loss(w: torch.Tensor, approx: torch.Tensor, calib: torch.Tensor) -> float:
    """``sqrt(tr(D H D^T) / tr(W H W^T))`` with ``D = W - W_hat`` ([N, K] each)."""
    h = calib.to(torch.float64)
    w64, d64 = w.double(), (w - approx).double()
    return (((d64 @ h) * d64).sum() / ((w64 @ h) * w64).sum().clamp_min(1e-300)).clamp_min(0).sqrt().item()

