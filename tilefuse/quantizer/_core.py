"""Building blocks of the VQ quantizer: weighted distances, code assignment, codebook refits.

Everything works on *targets* ``t: [n, G, d]`` (a row's weights split into ``G`` groups of ``d``
consecutive input dimensions, already divided by the row's scale), one codebook ``book: [E, d]``
and an optional per-group metric ``blocks: [G, d, d]`` (the ``d x d`` diagonal blocks of the
calibration matrix ``H = X^T X``; ``None`` means the identity, i.e. plain weight MSE). The error of
representing ``t[n, g]`` by ``c`` is ``(t - c)^T H_g (t - c)``; rows are weighted by ``scale^2`` so
that errors add up in units of the original weight.
"""

from __future__ import annotations

import torch

# Peak size of the [rows, G, E] distance tensors built at once (bytes).
_CHUNK_BYTES = 1 << 28


def group_blocks(calib: torch.Tensor, d: int, damp: float = 0.01) -> torch.Tensor:
    """``[K, K]`` calibration matrix -> its ``[K/d, d, d]`` diagonal blocks, normalised.

    The blocks are divided by the mean diagonal of ``H`` (the scale of ``H`` does not matter) and
    damped by ``damp * I`` as GPTQ does, so every block is positive definite even for inputs that
    are always zero.
    """
    num = calib.shape[0] // d
    h = calib.to(torch.float64)
    h = (h + h.T) / 2
    blocks = h.reshape(num, d, num, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    mean_diag = blocks.diagonal(dim1=1, dim2=2).mean()
    if not torch.isfinite(mean_diag) or mean_diag <= 0:
        raise ValueError(f"calib: expected a positive semi-definite X^T X with a positive diagonal, "
                         f"got mean diagonal {mean_diag.item()}")
    eye = torch.eye(d, dtype=h.dtype, device=h.device)
    return (blocks / mean_diag + damp * eye).to(torch.float32).contiguous()


def apply_metric(t: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """``H_g t`` for ``t: [n, G, d]`` (``t`` itself for the identity metric)."""
    return t if blocks is None else torch.einsum("ngd,gde->nge", t, blocks)


def quadratic(t: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """``t^T H_g t`` -> ``[n, G]``."""
    return (t * apply_metric(t, blocks)).sum(-1)


def entry_norms(book: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """``c^T H_g c`` for every entry: ``[E]`` (identity) or ``[G, E]``."""
    if blocks is None:
        return (book * book).sum(-1)
    return (torch.matmul(book, blocks) * book).sum(-1)


def distances(t: torch.Tensor, book: torch.Tensor, blocks: torch.Tensor | None,
              norms: torch.Tensor) -> torch.Tensor:
    """``(t - c)^T H_g (t - c) - t^T H_g t`` for every entry ``c``: ``[n, G, E]``.

    One fused ``addmm``/``baddbmm`` (``norms - 2 t^T H_g c``), because on the CPU this is bound
    by writing the ``[n, G, E]`` result, not by the 8-long dot products.
    """
    n, num_groups, d = t.shape
    if blocks is None:
        return torch.addmm(norms[None], t.reshape(-1, d), book.T, alpha=-2).view(n, num_groups, -1)
    metric_book = torch.matmul(blocks, book.T)                                  # [G, d, E]
    out = torch.baddbmm(norms[:, None, :], t.transpose(0, 1), metric_book, alpha=-2)  # [G, n, E]
    return out.transpose(0, 1)


def row_chunks(num_rows: int, num_groups: int, width: int):
    """Row slices whose ``[rows, G, width]`` fp32 temporaries stay under the chunk budget."""
    step = max(1, _CHUNK_BYTES // (4 * num_groups * width))
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def assign(t: torch.Tensor, book: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """Nearest entry (under the metric) for every target: ``[n, G]`` int64."""
    norms = entry_norms(book, blocks)
    out = torch.empty(t.shape[:2], dtype=torch.int64, device=t.device)
    for rows in row_chunks(t.shape[0], t.shape[1], book.shape[0]):
        out[rows] = distances(t[rows], book, blocks, norms).argmin(-1)
    return out


def refit_book(t: torch.Tensor, index: torch.Tensor, row_weight: torch.Tensor,
               blocks: torch.Tensor | None, old: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """Least-squares entries of one codebook given the codes: ``[E, d]``.

    Entry ``e`` minimises ``sum w_n (t - c_e)^T H_g (t - c_e)`` over the targets coded ``e``, i.e.
    solves ``(sum w_n H_g) c_e = sum w_n H_g t``: one ``d x d`` system per entry. A small ridge
    towards the old value keeps unused entries where they were.
    """
    num_entries, d = old.shape
    num_groups = t.shape[1]
    flat_index = index.reshape(-1)
    weight = row_weight.to(torch.float64)[:, None].expand(index.shape).reshape(-1)
    rhs = torch.zeros(num_entries, d, dtype=torch.float64, device=t.device)
    rhs.index_add_(0, flat_index, (weight[:, None] * apply_metric(t, blocks).reshape(-1, d).double()))
    if blocks is None:
        count = torch.zeros(num_entries, dtype=torch.float64, device=t.device).index_add_(0, flat_index, weight)
        lam = ridge * count.mean() + 1e-30
        # float64 throughout: ``lam`` grows with the row weights (scale^2: 1e46 for a row of 1e23),
        # and a 0-d float64 tensor times an fp32 one stays fp32, where lam * old overflowed to inf
        return ((rhs + lam * old.double()) / (count + lam)[:, None]).to(old.dtype)
    group_of = torch.arange(num_groups, device=t.device).expand(index.shape).reshape(-1)
    counts = torch.zeros(num_groups * num_entries, dtype=torch.float64, device=t.device)
    counts.index_add_(0, group_of * num_entries + flat_index, weight)
    lhs = torch.einsum("ge,gij->eij", counts.view(num_groups, num_entries), blocks.double())
    lam = ridge * lhs.diagonal(dim1=1, dim2=2).mean() + 1e-30
    eye = torch.eye(d, dtype=torch.float64, device=t.device)
    sol = torch.linalg.solve(lhs + lam * eye, (rhs + lam * old.double()).unsqueeze(-1))
    return sol.squeeze(-1).to(old.dtype)


def refit_pair_joint(t: torch.Tensor, codes: torch.Tensor, row_weight: torch.Tensor,
                     books: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """Joint least squares of both codebooks under the identity metric: ``[2, E, d]``.

    With ``H = I`` the ``2*E*d`` unknowns split into ``d`` independent ``2E x 2E`` systems that share
    one normal matrix ``P = sum w (e_a + e_b)(e_a + e_b)^T``. ``P`` is singular along ``C0 + u,
    C1 - u`` (only the sum of two entries is seen); the ridge towards the old books pins that.
    """
    _, num_entries, d = books.shape
    a, b = codes[..., 0].reshape(-1), codes[..., 1].reshape(-1)
    weight = row_weight.to(torch.float64)[:, None].expand(codes.shape[:2]).reshape(-1)
    dev = t.device
    count0 = torch.zeros(num_entries, dtype=torch.float64, device=dev).index_add_(0, a, weight)
    count1 = torch.zeros(num_entries, dtype=torch.float64, device=dev).index_add_(0, b, weight)
    cross = torch.zeros(num_entries * num_entries, dtype=torch.float64, device=dev)
    cross = cross.index_add_(0, a * num_entries + b, weight).view(num_entries, num_entries)
    normal = torch.cat([torch.cat([torch.diag(count0), cross], 1),
                        torch.cat([cross.T, torch.diag(count1)], 1)], 0)
    wt = weight[:, None] * t.reshape(-1, d).double()
    rhs = torch.zeros(2 * num_entries, d, dtype=torch.float64, device=dev)
    rhs.index_add_(0, a, wt).index_add_(0, b + num_entries, wt)
    lam = ridge * normal.diagonal().mean() + 1e-30
    normal += lam * torch.eye(2 * num_entries, dtype=torch.float64, device=dev)
    rhs += lam * books.reshape(-1, d).double()
    return torch.linalg.solve(normal, rhs).view_as(books).to(books.dtype)


def row_rms(w: torch.Tensor) -> torch.Tensor:
    """RMS of each row of ``w: [N, G, d]``, without overflow or underflow: each row is divided by
    its largest magnitude before squaring (a row of 1e20 squared would overflow fp32 to inf)."""
    peak = w.abs().amax((1, 2))
    safe = torch.where(peak > 0, peak, torch.ones_like(peak))
    return (w / safe[:, None, None]).pow(2).mean((1, 2)).sqrt() * safe


def row_weights(scales: torch.Tensor) -> torch.Tensor:
    """``scale^2`` per row in float64 (the rows' weights in the codebook refits): a scale of 1e20
    squares to 1e40, beyond fp32."""
    return scales.to(torch.float64).pow(2)


def kmeans(t: torch.Tensor, row_weight: torch.Tensor, blocks: torch.Tensor | None, num_entries: int,
           iters: int, generator: torch.Generator, sample: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Lloyd k-means of the targets ``[n, G, d]`` -> (book ``[E, d]``, codes ``[n, G]``).

    The Lloyd iterations see at most ``sample`` targets (whole rows drawn at random: 256 entries
    need far fewer than the millions of groups of a large layer); the returned codes cover all.
    Seeds are distinct targets drawn with ``generator`` (with repeats when there are fewer targets
    than entries; duplicate entries simply stay unused).
    """
    if t.shape[0] * t.shape[1] > sample:  # Lloyd on a random subset of rows, final assignment on all
        keep = max(1, sample // t.shape[1])
        rows = torch.randperm(t.shape[0], generator=generator, device=t.device)[:keep]
        book, _ = kmeans(t[rows], row_weight[rows], blocks, num_entries, iters, generator, sample)
        return book, assign(t, book, blocks)
    flat = t.reshape(-1, t.shape[-1])
    pick = torch.randperm(flat.shape[0], generator=generator, device=t.device)[:num_entries]
    if pick.numel() < num_entries:
        extra = torch.randint(flat.shape[0], (num_entries - pick.numel(),), generator=generator, device=t.device)
        pick = torch.cat([pick, extra])
    book = flat[pick].clone()
    for _ in range(iters):
        book = refit_book(t, assign(t, book, blocks), row_weight, blocks, book)
    return book, assign(t, book, blocks)
