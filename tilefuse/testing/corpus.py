"""The shape corpus: the linear layers of public model configurations, as the ops see them.

Each :class:`ModelConfig` is written down from the model's published ``config.json`` (hidden size,
intermediate sizes, expert sizes, head counts; nothing measured). From it :func:`swiglu_shapes`
derives the gate/up problems ``(H, I)`` of its SwiGLU MLPs (dense, routed experts, shared experts)
and :func:`linear_shapes` every projection ``(N, K)`` a 2-bit layer would replace, each also
sharded for tensor parallelism: column-parallel layers (q/k/v, gate/up, MLA's q_b and kv_b) keep
K and split N, row-parallel ones (o, down) keep N and split K; a SwiGLU MLP splits I. A sharding
is listed only where it divides evenly (what vLLM and SGLang accept).

Token counts span the five buckets a server sees, odd values included (:data:`TOKENS`).
``--quick`` runs and the CPU tests take :func:`quick_cases`, a fixed subsample; the benchmark and
``tilefuse tune`` read :func:`cases` (the whole corpus) or one model's shapes.

Held-out models (:data:`HELD_OUT`) are kept apart: nothing is tuned on them, and the benchmark
reports them separately, so the dispatch rules are checked on shapes they were not fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# tokens per call: 1 | 2-16 | 17-128 | 129-1024 | 1025-16384
TOKEN_BUCKETS = ((1, 1), (2, 16), (17, 128), (129, 1024), (1025, 16384))
TOKENS = (1, 3, 7, 16, 33, 100, 128, 333, 1000, 1025, 3000, 8191, 16384)
TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of one model that fix its linear layers (names as in the published config)."""
    name: str
    hidden: int                          # hidden_size
    intermediate: int | None             # intermediate_size of the dense MLP (None: every layer MoE)
    heads: int                           # num_attention_heads
    kv_heads: int                        # num_key_value_heads (= heads without GQA)
    head_dim: int                        # head_dim (hidden / heads unless the config says)
    moe_intermediate: int | None = None  # per routed expert
    experts: int = 0                     # routed experts
    shared_intermediate: int | None = None  # all shared experts together (one MLP)
    mla: dict = field(default_factory=dict)  # q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head
    family: str = "dense"                # dense | moe


def _dense(name, hidden, inter, heads, kv, head_dim=None):
    return ModelConfig(name, hidden, inter, heads, kv, head_dim or hidden // heads)


def _moe(name, hidden, inter, heads, kv, head_dim, moe_inter, experts, shared=None, mla=None):
    return ModelConfig(name, hidden, inter, heads, kv, head_dim, moe_inter, experts, shared, mla or {}, "moe")


MODELS: dict[str, ModelConfig] = {m.name: m for m in [
    # Llama 3.x
    _dense("llama3.2-1b", 2048, 8192, 32, 8, 64),
    _dense("llama3.2-3b", 3072, 8192, 24, 8, 128),
    _dense("llama3.1-8b", 4096, 14336, 32, 8),
    _dense("llama3.1-70b", 8192, 28672, 64, 8),
    _dense("llama3.1-405b", 16384, 53248, 128, 8),
    # Qwen2.5 (dense)
    _dense("qwen2.5-0.5b", 896, 4864, 14, 2),
    _dense("qwen2.5-1.5b", 1536, 8960, 12, 2),
    _dense("qwen2.5-3b", 2048, 11008, 16, 2),
    _dense("qwen2.5-7b", 3584, 18944, 28, 4),
    _dense("qwen2.5-14b", 5120, 13824, 40, 8),
    _dense("qwen2.5-32b", 5120, 27648, 40, 8),
    _dense("qwen2.5-72b", 8192, 29568, 64, 8),
    # Qwen3 (dense and MoE; head_dim 128 throughout)
    _dense("qwen3-8b", 4096, 12288, 32, 8, 128),
    _dense("qwen3-32b", 5120, 25600, 64, 8, 128),
    _moe("qwen3-30b-a3b", 2048, None, 32, 4, 128, 768, 128),
    _moe("qwen3-235b-a22b", 4096, None, 64, 4, 128, 1536, 128),
    # Mistral / Mixtral
    _dense("mistral-7b", 4096, 14336, 32, 8),
    _dense("mistral-nemo-12b", 5120, 14336, 32, 8, 128),
    _moe("mixtral-8x7b", 4096, None, 32, 8, 128, 14336, 8),
    _moe("mixtral-8x22b", 6144, None, 48, 8, 128, 16384, 8),
    # Phi
    _dense("phi3-mini", 3072, 8192, 32, 32, 96),
    _dense("phi4-14b", 5120, 17920, 40, 10, 128),
    # DeepSeek (MLA attention; the first layers dense, the rest routed + shared experts)
    _moe("deepseek-v2-lite", 2048, 10944, 16, 16, 192, 1408, 64, 2 * 1408,
         dict(q_lora_rank=None, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)),
    _moe("deepseek-v2", 5120, 12288, 128, 128, 192, 1536, 160, 2 * 1536,
         dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)),
    _moe("deepseek-v3", 7168, 18432, 128, 128, 192, 2048, 256, 2048,
         dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)),
    # GLM
    _dense("glm4-9b", 4096, 13696, 32, 2, 128),
    _moe("glm4.5", 5120, 12288, 96, 8, 128, 1536, 160, 1536),
    # Llama 4 (routed experts + one shared expert of the same size; dense interleaved layers)
    _moe("llama4-scout", 5120, 16384, 40, 8, 128, 8192, 16, 8192),
    _moe("llama4-maverick", 5120, 16384, 40, 8, 128, 8192, 128, 8192),
]}

# Kept out of every table and heuristic that was fitted by measurement; the benchmark reports them
# apart (``--corpus`` marks them ``held_out``).
HELD_OUT = ("phi4-14b", "glm4.5", "llama3.2-3b", "mistral-nemo-12b")


@dataclass(frozen=True)
class Shape:
    """One problem of a model: ``op`` is ``"swiglu"`` (dims = (H, I)) or ``"linear"`` (dims =
    (N, K), ``y = x W^T`` with ``W [N, K]``); ``role`` says which layer, ``tp`` its sharding."""
    model: str
    op: str
    role: str
    dims: tuple[int, int]
    tp: int = 1

    @property
    def held_out(self) -> bool:
        return self.model in HELD_OUT


def _splits(tp: int, *sizes: int, multiple: int = 8) -> bool:
    return all(s % tp == 0 and (s // tp) % multiple == 0 for s in sizes)


def swiglu_shapes(model: ModelConfig, tp_degrees=TP_DEGREES) -> list[Shape]:
    """Gate/up problems ``(H, I / tp)`` of the model's SwiGLU MLPs: dense, routed expert, shared."""
    mlps = [("mlp", model.intermediate), ("expert", model.moe_intermediate), ("shared", model.shared_intermediate)]
    out = []
    for role, inter in mlps:
        if inter is None:
            continue
        for tp in tp_degrees:
            if _splits(tp, inter):
                out.append(Shape(model.name, "swiglu", role, (model.hidden, inter // tp), tp))
    return out


def _attention_layers(model: ModelConfig) -> list[tuple[str, int, int, str]]:
    """(role, N, K, parallel) of the attention projections; parallel: "col" or "row"."""
    h = model.hidden
    if not model.mla:
        q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
        return [("qkv", q + 2 * kv, h, "col"), ("o", h, q, "row")]
    m = model.mla
    qk = m["qk_nope"] + m["qk_rope"]
    layers = [("kv_a", m["kv_lora_rank"] + m["qk_rope"], h, "rep"),
              ("kv_b", model.heads * (m["qk_nope"] + m["v_head"]), m["kv_lora_rank"], "col"),
              ("o", h, model.heads * m["v_head"], "row")]
    if m["q_lora_rank"]:
        layers += [("q_a", m["q_lora_rank"], h, "rep"), ("q_b", model.heads * qk, m["q_lora_rank"], "col")]
    else:
        layers += [("q", model.heads * qk, h, "col")]
    return layers


def linear_shapes(model: ModelConfig, tp_degrees=TP_DEGREES) -> list[Shape]:
    """Every projection ``(N, K)`` of one block (attention, MLP, expert, shared expert), sharded:
    column-parallel ``(N / tp, K)``, row-parallel ``(N, K / tp)``, replicated ones (MLA's low-rank
    down-projections) once."""
    layers = _attention_layers(model)
    for role, inter in (("mlp", model.intermediate), ("expert", model.moe_intermediate),
                        ("shared", model.shared_intermediate)):
        if inter is not None:
            layers += [(f"{role}.gate_up", 2 * inter, model.hidden, "col"),
                       (f"{role}.down", model.hidden, inter, "row")]
    out = []
    for role, n, k, parallel in layers:
        for tp in tp_degrees:
            if parallel == "rep":
                if tp == 1:
                    out.append(Shape(model.name, "linear", role, (n, k), 1))
            elif parallel == "col" and _splits(tp, n):
                out.append(Shape(model.name, "linear", role, (n // tp, k), tp))
            elif parallel == "row" and _splits(tp, k):
                out.append(Shape(model.name, "linear", role, (n, k // tp), tp))
    return out


def shapes(op: str, models=None, tp_degrees=TP_DEGREES, held_out: bool | None = None) -> list[Shape]:
    """Distinct problems of ``op`` ("swiglu" or "linear") over ``models`` (names; default all),
    first occurrence kept (a shape shared by several models is timed once). ``held_out``: only
    the held-out models (True), none of them (False), or all (None)."""
    pick = swiglu_shapes if op == "swiglu" else linear_shapes
    seen, out = set(), []
    for name in models or MODELS:
        model = MODELS[name]
        if held_out is not None and (name in HELD_OUT) != held_out:
            continue
        for s in pick(model, tp_degrees):
            if s.dims not in seen:
                seen.add(s.dims)
                out.append(s)
    return out


def cases(op: str, models=None, tokens=TOKENS, tp_degrees=TP_DEGREES, held_out: bool | None = None
          ) -> list[tuple[Shape, int]]:
    """Every (shape, tokens) pair of the corpus for ``op``."""
    return [(s, m) for s in shapes(op, models, tp_degrees, held_out) for m in tokens]


def quick_cases(op: str, per_bucket: int = 1) -> list[tuple[Shape, int]]:
    """A fixed subsample: every ``stride``-th distinct shape, each at one token count per bucket
    picked in rotation (deterministic: the same list on every machine)."""
    all_shapes = shapes(op)
    stride = max(1, len(all_shapes) // 12)
    picked = all_shapes[::stride]
    out = []
    for i, s in enumerate(picked):
        for b, (lo, hi) in enumerate(TOKEN_BUCKETS):
            in_bucket = [t for t in TOKENS if lo <= t <= hi]
            for j in range(per_bucket):
                out.append((s, in_bucket[(i + j) % len(in_bucket)]))
    return out


def bucket_of(tokens: int) -> str:
    """The bucket label of a token count: "1", "2-16", "17-128", "129-1024" or "1025-16384"."""
    for lo, hi in TOKEN_BUCKETS:
        if lo <= tokens <= hi:
            return f"{lo}" if lo == hi else f"{lo}-{hi}"
    raise ValueError(f"tokens: expected 1 to {TOKEN_BUCKETS[-1][1]}, got {tokens}")
