"""The layers ``tilefuse bench tp`` times at TP=1 and TP=N (:mod:`tilefuse.bench.tp`): a fused
SwiGLU MLP, a 2-bit VQ MLP and a DeepSeek-V3 MLA decode layer, built from one seed on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# DeepSeek-V3's MLA: hidden, q latent (q_lora_rank), nope / rope query dims, value head dim
MLA_DIMS = dict(hidden=7168, q_rank=1536, nope=128, rope=64, v_head=128)


def _draw(gen: torch.Generator, shape, std: float, dtype, device) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)


def mlp_layer(hidden: int, inter: int, dtype, device, seed: int = 0) -> nn.Module:
    """A FusedSwiGLUMLP with random O(1)-output weights, the same on every rank."""
    from tilefuse.nn.swiglu import FusedSwiGLUMLP

    gen = torch.Generator(device=device).manual_seed(seed)
    mlp = FusedSwiGLUMLP(hidden, inter, device="meta", dtype=dtype)
    mlp.gate_up_weight = nn.Parameter(_draw(gen, (2 * inter, hidden), hidden ** -0.5, dtype, device),
                                      requires_grad=False)
    mlp.down_proj.weight = nn.Parameter(_draw(gen, (hidden, inter), inter ** -0.5, dtype, device), requires_grad=False)
    return mlp


class VQMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` over 2x8 VQ projections (or their tensor-parallel shards)."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def vq_mlp(hidden: int, inter: int, dtype, device, seed: int = 0) -> VQMLP:
    from tilefuse.nn.vq import VQLinear

    gen = torch.Generator(device=device).manual_seed(seed)

    def layer(n, k):
        vq = VQLinear(k, n, bias=False, dtype=dtype, device=device)
        codes = torch.randint(0, 256, (n, k // 8, 2), generator=gen, device=device, dtype=torch.uint8)
        books = _draw(gen, (2, 256, 1, 8), 0.5 ** 0.5, dtype, device)
        return vq.load_quantized(codes, books, torch.full((n,), k ** -0.5, dtype=dtype, device=device))

    return VQMLP(layer(inter, hidden), layer(inter, hidden), layer(hidden, inter))


def shard_vq_mlp(mlp: VQMLP, group, reduce_results: bool = True) -> VQMLP:
    from tilefuse.parallel import shard

    return VQMLP(shard(mlp.gate, group, style="column"), shard(mlp.up, group, style="column"),
                 shard(mlp.down, group, style="row", reduce_results=reduce_results))


class MLADecodeLayer(nn.Module):
    """One decode step of a DeepSeek-style MLA layer with absorbed weights, on ``heads`` heads.

    c_q ``[b, q_rank]`` -> q_b projection -> per head (nope, rope) -> q_nope W_UK -> latent query
    ``[b, 1, h, 576]`` -> paged attention -> W_UV ``[h, 512, v]`` -> o_proj ``[hidden, h v]`` -> ``[b, hidden]``.
    Built full (TP=1) by :func:`mla_layer`, or as a rank's shard by :meth:`shard`.
    """

    def __init__(self, q_b: nn.Module, w_uk: torch.Tensor, w_uv: torch.Tensor, attn: nn.Module, o_proj: nn.Module):
        super().__init__()
        self.q_b, self.attn, self.o_proj = q_b, attn, o_proj
        self.register_buffer("w_uk", w_uk)          # [h, nope, 512]
        self.register_buffer("w_uv", w_uv)          # [h, 512, v]

    def forward(self, c_q, k_cache, block_table):
        """c_q [b, q_rank]; the attention's schedule from its last ``plan(cache_seqlens)`` (once per step)."""
        b, heads = c_q.shape[0], self.w_uk.shape[0]
        q = self.q_b(c_q).view(b, heads, MLA_DIMS["nope"] + MLA_DIMS["rope"])
        q_nope, q_pe = q.split((MLA_DIMS["nope"], MLA_DIMS["rope"]), dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)               # [b, h, 512]
        q = torch.cat((q_latent, q_pe), dim=-1).unsqueeze(1)                                   # [b, 1, h, 576]
        out, _ = self.attn(q, k_cache, block_table)                                             # [b, 1, h, 512]
        v = torch.bmm(out[:, 0].transpose(0, 1), self.w_uv).transpose(0, 1).reshape(b, -1)    # [b, h v]
        return self.o_proj(v)

    def shard(self, group, reduce_results: bool = True) -> MLADecodeLayer:
        """This rank's heads: q_b rows, W_UK / W_UV heads, attention heads, o_proj columns."""
        from tilefuse.parallel import placement, shard

        where = placement(group)
        heads = where.part(self.w_uk.shape[0])
        return MLADecodeLayer(shard(self.q_b, group, style="column").local, self.w_uk[heads].contiguous(),
                              self.w_uv[heads].contiguous(), shard(self.attn, group),
                              shard(self.o_proj, group, style="row", reduce_results=reduce_results))


def mla_layer(heads: int, dtype, device, seed: int = 0) -> MLADecodeLayer:
    from tilefuse.nn.mla import MLADecodeAttention
    from tilefuse.parallel.sharding import linear_from

    d = MLA_DIMS
    gen = torch.Generator(device=device).manual_seed(seed)
    q_b = linear_from(_draw(gen, (heads * (d["nope"] + d["rope"]), d["q_rank"]), d["q_rank"] ** -0.5, dtype, device),
                      None)
    w_uk = _draw(gen, (heads, d["nope"], 512), d["nope"] ** -0.5, dtype, device)
    w_uv = _draw(gen, (heads, 512, d["v_head"]), 512 ** -0.5, dtype, device)
    o_proj = linear_from(_draw(gen, (d["hidden"], heads * d["v_head"]), (heads * d["v_head"]) ** -0.5, dtype,
                               device), None)
    return MLADecodeLayer(q_b, w_uk, w_uv, MLADecodeAttention(heads), o_proj)
