"""AQLM 2x8 vector-quantized linear layer in plain PyTorch: the executable spec of ``tilefuse.vq_matmul``.

Format (AQLM's, ``num_codebooks=2, nbits_per_codebook=8, in_group_size=8, out_group_size=1``):

* codes     ``[N, K/8, 2]`` uint8, or int8 as AQLM stores them (two's complement: int8 -1 is code 255)
* codebooks ``[2, 256, 1, 8]`` fp16/bf16
* scales    ``[N, 1, 1, 1]``
* bias      ``[N]`` or None

``W[n, 8g:8g+8] = scales[n] * (C0[codes[n, g, 0]] + C1[codes[n, g, 1]])`` and ``y = x @ W^T + bias``.
"""

from __future__ import annotations

import torch


def codes_as_index(codes: torch.Tensor) -> torch.Tensor:
    """uint8 or int8 codes -> int64 indices in [0, 256)."""
    return codes.to(torch.int64) & 0xFF


def dequantize(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor, *,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense weight ``[N, K]`` in ``dtype`` (the codebooks' dtype by default)."""
    dtype = dtype or codebooks.dtype
    num_rows, num_groups, num_codebooks = codes.shape
    index = codes_as_index(codes)                            # [N, G, 2]
    books = codebooks.to(dtype)[:, :, 0, :]                   # [2, 256, 8]
    groups = sum(books[c][index[..., c]] for c in range(num_codebooks))   # [N, G, 8]
    weight = groups * scales.to(dtype).reshape(num_rows, 1, 1)
    return weight.reshape(num_rows, num_groups * books.shape[-1])


def vq_matmul_reference(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None, *, compute_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W^T + bias``. x: [..., K]; returns [..., N] in ``out_dtype`` (x's dtype by default)."""
    weight = dequantize(codes, codebooks, scales, dtype=compute_dtype)
    out = x.to(compute_dtype) @ weight.T
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out.to(out_dtype or x.dtype)


def vq_swiglu_reference(x: torch.Tensor, gate_codes: torch.Tensor, gate_codebooks: torch.Tensor,
                        gate_scales: torch.Tensor, up_codes: torch.Tensor, up_codebooks: torch.Tensor,
                        up_scales: torch.Tensor, gate_bias: torch.Tensor | None = None,
                        up_bias: torch.Tensor | None = None, *, compute_dtype: torch.dtype = torch.float32,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(x @ Wg^T + bg) * (x @ Wu^T + bu)`` for two 2x8 weights (the spec of ``tilefuse.vq_swiglu``):
    both weights dequantized and both projections computed in ``compute_dtype``, SiLU times up in
    ``compute_dtype``, one rounding to ``out_dtype`` (x's dtype by default). x: [..., K]; returns [..., N]."""
    xc = x.to(compute_dtype)
    gate = torch.nn.functional.linear(xc, dequantize(gate_codes, gate_codebooks, gate_scales, dtype=compute_dtype),
                                      None if gate_bias is None else gate_bias.to(compute_dtype))
    up = torch.nn.functional.linear(xc, dequantize(up_codes, up_codebooks, up_scales, dtype=compute_dtype),
                                    None if up_bias is None else up_bias.to(compute_dtype))
    return (gate * torch.sigmoid(gate) * up).to(out_dtype or x.dtype)


def vq_moe_reference(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up_codes: torch.Tensor, gate_up_codebooks: torch.Tensor, gate_up_scales: torch.Tensor,
                     down_codes: torch.Tensor, down_codebooks: torch.Tensor, down_scales: torch.Tensor, *,
                     compute_dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MoE experts with 2x8 weights (the spec of ``tilefuse.vq_moe``): for each token ``t`` and slot
    ``j`` with expert ``e = top_k_index[t, j]`` in ``[0, E)``:

    ``gu = x[t] @ W_gu[e]^T`` (``W_gu[e]``: ``[2I, H]``, gate rows ``[0, I)``, up rows ``[I, 2I)``),
    ``h = silu(gu[:I]) * gu[I:]`` rounded to x's dtype (the kernels keep the expert's intermediate
    activation in x's dtype, as a model does), ``y[t] += top_k_weights[t, j] * (h @ W_d[e]^T)``
    (``W_d[e]``: ``[H, I]``), everything else in ``compute_dtype``, one rounding of ``y`` to
    ``out_dtype`` (x's dtype by default). A slot whose expert id lies outside ``[0, E)`` contributes
    nothing (transformers' expert-parallel sentinel is ``E``). No tokens: ``[0, H]``.

    Shapes: x ``[T, H]``; top_k_index ``[T, k]`` integer; top_k_weights ``[T, k]`` floating;
    gate_up_codes ``[E, 2I, H/8, 2]``, gate_up_codebooks ``[E, 2, 256, 1, 8]``, gate_up_scales
    ``[E, 2I]`` (or ``[E, 2I, 1, 1, 1]``); down_codes ``[E, H, I/8, 2]``, down_codebooks
    ``[E, 2, 256, 1, 8]``, down_scales ``[E, H]`` (or ``[E, H, 1, 1, 1]``). Reads the routing back
    to the host (a loop over the experts hit)."""
    num_experts, rows = gate_up_codes.shape[:2]
    inter = rows // 2
    xc = x.to(compute_dtype)
    out = torch.zeros(x.shape[0], down_codes.shape[1], dtype=compute_dtype, device=x.device)
    for e in torch.unique(top_k_index).tolist():
        if not 0 <= e < num_experts:
            continue
        tokens, slots = (top_k_index == e).nonzero(as_tuple=True)
        gu = xc[tokens] @ dequantize(gate_up_codes[e], gate_up_codebooks[e], gate_up_scales[e],
                                     dtype=compute_dtype).T
        gate, up = gu[:, :inter], gu[:, inter:]
        h = (gate * torch.sigmoid(gate) * up).to(x.dtype).to(compute_dtype)
        y = h @ dequantize(down_codes[e], down_codebooks[e], down_scales[e], dtype=compute_dtype).T
        out.index_add_(0, tokens, y * top_k_weights[tokens, slots].to(compute_dtype)[:, None])
    return out.to(out_dtype or x.dtype)
