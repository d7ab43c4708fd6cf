"""``tilefuse bench model``: the CPU pipeline check end to end, and the pieces the GPU run relies on
(the static-cache decode route against ``generate()``, agreement, goals, case selection)."""

import json
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilefuse.bench import hf_decode, hf_models  # noqa: E402
from tilefuse.bench import model as bench_model  # noqa: E402

TEXT = " ".join(f"In the beginning {i} was the word, and the word was with {i % 7} and was good." for i in range(120))


def tiny(arch="llama", dtype=torch.float32):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = transformers.Qwen2Config(**common) if arch == "qwen2" else transformers.LlamaConfig(**common)
    return hf_models.random_model(config, torch.device("cpu"), dtype)


def test_cli_pipeline_check_writes_the_results(tmp_path, capsys):
    """The CPU run end to end through the CLI's code: every variant decodes, agreement and
    perplexity are recorded, nothing is timed, stdout is one line, no plot."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert bench_model.main(out_dir=tmp_path, text=str(text), device=torch.device("cpu")) == 0
    data = json.loads(next(tmp_path.glob("model-*.json")).read_text())
    assert {"machine", "plan", "timing", "models", "rows", "summary"} <= set(data) and "incomplete" not in data
    assert {"gpu", "torch", "triton", "transformers", "date"} <= set(data["machine"])
    assert data["timing"]["mode"] == "cpu-pipeline-check"
    assert set(data["models"]["tiny-llama"]["variants"]) == set(bench_model.VARIANTS)
    assert data["models"]["tiny-llama"]["variants"]["vq2"]["codes"] == "calibrated"
    assert set(data["models"]["tiny-deepseek"]["variants"]) == set(bench_model.MLA_VARIANTS)
    rows = data["rows"]
    decode = [r for r in rows if r["mode"] == "eager"]
    assert {(r["model"], r["variant"], r["batch"]) for r in decode} == (
        {("tiny-llama", v, b) for v in bench_model.VARIANTS for b in (1, 16)}
        | {("tiny-deepseek", v, b) for v in bench_model.MLA_VARIANTS for b in (1, 16)})
    # the MLA variants decode over the paged latent cache (the absorbed form, on the op's reference
    # path): stock's choices at every position given the same prefix; free-running, a near-tie of
    # the random tiny model may flip a late token
    deepseek = [r for r in decode if r["model"] == "tiny-deepseek"]
    assert all(r["agreement_forced"] == 1.0 and r["agreement"] >= 0.9 for r in deepseek), deepseek
    for r in decode:
        assert "error" not in r, r
        assert 0 <= r["agreement"] <= 1 and 0 <= r["agreement_forced"] <= 1
        assert not {"ms_per_token", "tokens_per_s", "x_stock", "timed_steps"} & set(r)
    assert all(0 <= r["self_consistency"] <= 1 for r in decode if r["variant"] == "stock")
    assert all(r["agreement"] == 1.0 for r in decode if r["variant"] == "stock")
    perplexity = {r["variant"] for r in rows if r["mode"] == "perplexity" and r["perplexity"] > 0}
    assert perplexity == set(bench_model.VARIANTS)          # the tiny Llama reads text; the DeepSeek one no
    assert not [r for r in rows if r["mode"] == "prefill"]
    assert data["summary"] == {"pipeline_check": {"cases": 14, "calls": len(rows), "failed": []}}
    assert capsys.readouterr().out == "model: pipeline check: 14 cases ran on the reference path, nothing timed\n"
    assert not list(tmp_path.glob("*.png"))


class LoadedMachine:
    """A forward pre-hook that sleeps in the first step of every decode (the prefill: more than one
    token in), as a machine under load does now and then: ``load_s`` seconds the first time, less
    each time after, so that no two decodes of one length take the same time."""

    def __init__(self, load_s: float):
        self.load_s, self.prefills = load_s, 0

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids.shape[1] > 1:
            time.sleep(self.load_s / (1 + self.prefills))
            self.prefills += 1


class Prefills:
    """A forward pre-hook that appends ``name`` to ``calls`` at every decode's first step (the prefill)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            self.calls.append(self.name)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_decode_timing_is_of_decode_steps_alone_on_a_loaded_machine(mode):
    """ms_per_token is the median of the decode steps' own times: positive, and untouched by slow
    first steps (a difference of whole decodes' times goes negative whenever the slow first steps
    fall in the shorter decodes)."""
    load = LoadedMachine(0.4)
    model = tiny()
    model.register_forward_pre_hook(load, with_kwargs=True)
    subject = hf_models.Subject("tiny", lambda: model, 256, {})
    plan = bench_model.CPU_PLAN
    prompt = torch.randint(0, 256, (2, 16))
    row, tokens = bench_model.decode_row(model, subject, "stock", mode, prompt, plan, torch.device("cpu"))
    assert "error" not in row, row
    rounds = plan.eager_rounds if mode == "eager" else 1
    assert load.prefills == rounds + (mode == "eager")             # eager: a warm-up decode, then the timed ones
    assert row["timed_steps"] == rounds * (plan.new_tokens - 1 - plan.skip_tokens)
    assert tokens.shape == (2, plan.new_tokens) and "stock_ms_paired" not in row
    assert 0 < row["ms_per_token"] < 150, row                       # the sleeps were 200-400 ms
    assert row["tokens_per_s"] == pytest.approx(2e3 / row["ms_per_token"], rel=1e-3)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_rows_time_stock_beside_them(mode):
    """A row with ``paired`` decodes the stock model in alternating rounds with its own and its
    x_stock comes from those rounds: a variant 100 ms per step slower than stock reads well below 1
    however slow the stock row measured minutes before was. Graph rows capture once per model (on a CPU the
    step runs eagerly) and replay every round."""
    stock, slow = tiny(), tiny()

    def delay(module, args, kwargs):   # every decode step of the "variant" sleeps 100 ms
        time.sleep(0.1)

    slow.register_forward_pre_hook(delay, with_kwargs=True)
    calls = []
    for name, model in (("stock", stock), ("slow", slow)):
        model.register_forward_pre_hook(Prefills(name, calls), with_kwargs=True)
    subject = hf_models.Subject("tiny", tiny, 256, {})
    plan = bench_model.Plan(**{**bench_model.CPU_PLAN.__dict__, "eager_rounds": 2, "graph_rounds": 2})
    prompt = torch.randint(0, 256, (1, 8))
    row, tokens = bench_model.decode_row(slow, subject, "slow", mode, prompt, plan, torch.device("cpu"),
                                         paired=stock)
    assert "error" not in row and row["rounds"] == 2 and tokens.shape == (1, plan.new_tokens)
    warm_up = ["slow"] if mode == "eager" else []
    assert calls == warm_up + ["slow", "stock", "stock", "slow"]     # (warm-up), then slow/stock, stock/slow
    assert row["timed_steps"] == 2 * (plan.new_tokens - 1 - plan.skip_tokens)
    # (the margins leave room for a loaded machine: the tiny model's own step took up to 30 ms there)
    assert row["ms_per_token"] > 100 and row["stock_ms_paired"] < row["ms_per_token"] - 50, row
    rows = [{"model": "tiny", "variant": "stock", "mode": mode, "batch": 1, "prompt_tokens": 8,
             "ms_per_token": 1e4}, row]
    bench_model.compare(rows, {})
    assert row["x_stock"] == row["x_stock_paired"] < 0.8


def test_prefill_times_a_paired_model_beside_its_own():
    """Prefill rows of a patched model time the stock model's forwards alternating with their own;
    compare() takes x_stock from those, not from the stock row measured earlier."""
    stock, slow = tiny(), tiny()
    slow.register_forward_pre_hook(lambda module, args, kwargs: time.sleep(0.1), with_kwargs=True)
    calls = []
    for name, model in (("stock", stock), ("slow", slow)):
        model.register_forward_pre_hook(Prefills(name, calls), with_kwargs=True)
    times = hf_decode.prefill_times(slow, torch.randint(0, 256, (1, 8)), torch.device("cpu"), reps=2, paired=stock)
    assert calls == ["slow", "stock", "stock", "slow", "slow", "stock"]      # warm-up round, then alternating
    assert times["prefill_ms"] > 100 and times["stock_ms_paired"] < times["prefill_ms"] - 50
    rows = [{"model": "m", "variant": "stock", "mode": "prefill", "batch": 1, "prompt_tokens": 8, "prefill_ms": 1e3},
            {"model": "m", "variant": "slow", "mode": "prefill", "batch": 1, "prompt_tokens": 8, **times}]
    bench_model.compare(rows, {})
    assert rows[1]["x_stock"] == round(times["stock_ms_paired"] / times["prefill_ms"], 4) < 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_static_cache_decode_matches_generate(arch, batch):
    """The graph route's step, run eagerly: same greedy tokens as generate() (twice: the cache resets)."""
    model = tiny(arch)
    prompt = torch.randint(0, 256, (batch, 11))
    expected = hf_decode.generate_eager(model, prompt, 12)
    decoder = hf_decode.GraphDecoder(model, batch, max_len=11 + 12, capture=False)
    for _ in range(2):
        clock = hf_decode.Clock(torch.device("cpu"), 12)
        assert torch.equal(decoder.decode(prompt, 12, clock), expected)
        assert len(clock.intervals_ms()) == 11
    assert torch.equal(hf_decode.forced_argmax(model, prompt, expected), expected)   # fp32: no near-ties
    decoder.prefill(prompt)                      # what the GPU capture does first: warm-up steps write ahead
    for _ in range(decoder.warmup_steps):
        decoder.step()
    assert torch.equal(decoder.decode(prompt, 12), expected)
    with pytest.raises(ValueError, match="prompt"):
        decoder.decode(prompt, 13)


def test_compare_fills_speedups_and_agreement():
    def row(variant, mode, ms):
        return {"model": "m", "variant": variant, "mode": mode, "batch": 2, "prompt_tokens": 9, "ms_per_token": ms}

    rows = [row("stock", "eager", 10.0), row("stock", "graph", 4.0), row("vq2", "eager", 5.0), row("vq2", "graph", 2.0),
            {"model": "m", "variant": "vq2", "mode": "prefill", "batch": 1, "prefill_ms": 3.0},
            {"model": "m", "variant": "stock", "mode": "prefill", "batch": 1, "prefill_ms": 6.0}]
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens = {("stock", "eager", 2, 9): ref, ("stock", "graph", 2, 9): ref,
              ("vq2", "eager", 2, 9): torch.tensor([[1, 2, 0, 4], [5, 6, 7, 8]]), ("vq2", "graph", 2, 9): ref}
    # another context of the same model, mode and batch is compared with its own stock row only
    rows.append({**row("vq2", "eager", 1.0), "prompt_tokens": 33})
    bench_model.compare(rows, tokens)
    assert [r.get("x_stock") for r in rows] == [1.0, 1.0, 2.0, 2.0, 2.0, 1.0, None]
    assert rows[2]["agreement"] == 0.875 and rows[2]["agreement_prefix"] == 0.75
    assert rows[3]["agreement"] == 1.0 and rows[3]["agreement_vs_eager"] == 0.875


def test_summary_goals():
    def row(model, variant, mode, batch, x, **extra):
        return {"model": model, "variant": variant, "mode": mode, "batch": batch, "ms_per_token": 1.0, "x_stock": x,
                **extra}

    rows = [row("llama3-8b", "swiglu", "eager", 1, 1.2), row("llama3-8b", "swiglu", "graph", 16, 0.9),
            row("llama3-8b", "vq2", "graph", 1, 2.1), row("llama3-8b", "vq2", "eager", 1, 1.4),
            row("smollm2-135m", "stock", "eager", 16, 1.0, self_consistency=0.97),
            row("smollm2-135m", "swiglu", "eager", 1, 1.0, agreement_forced=1.0),
            row("smollm2-135m", "swiglu", "eager", 16, 1.0, agreement_forced=0.962)]
    goals = {g["goal"].split(":")[0]: g for g in bench_model.summarize(rows)["goals"]}
    swiglu = next(g for k, g in goals.items() if k.startswith("patch_swiglu never"))
    assert swiglu["measured"] == 0.9 and swiglu["met"] is False and swiglu["worst_case"] == "llama3-8b graph batch 16"
    vq = next(g for k, g in goals.items() if k.startswith("vq2 never"))
    assert vq["measured"] == 1.4 and vq["met"] is True
    graph = next(g for g in goals.values() if "Llama-3-8B" in g["goal"])
    assert graph["measured"] == 2.1 and graph["met"] is True and "(vq2)" in graph["goal"]
    tokens = next(g for g in goals.values() if "teacher-forced" in g["goal"])
    assert tokens["measured"] == 0.962 and tokens["target"] == ">= 0.96" and tokens["met"] is True
    assert all(g["met"] is None for g in bench_model.summarize(rows, judge=False)["goals"])


def test_only_selects_cases_like_the_kernel_benches(tmp_path):
    models = ["llama3-8b", "smollm2-135m"]
    assert bench_model.select(models, None) == {m: list(bench_model.VARIANTS) for m in models}
    # an --only run also offers the opt-in variants: vq2's unfused twin (its same-run baseline)
    assert bench_model.select(models, "vq2") == {m: ["stock", "vq2", "vq2_unfused"] for m in models}
    assert bench_model.select(models, '"vq2"') == {m: ["stock", "vq2"] for m in models}
    assert bench_model.select(models, "smollm2") == {"smollm2-135m": [*bench_model.VARIANTS, "vq2_unfused"]}
    assert bench_model.select(models, '"llama3-8b", "variant": "swiglu"') == {"llama3-8b": ["stock", "swiglu"]}
    own = bench_model.with_peers({"deepseek-v3": ("stock", "swiglu", "mla", "mla_swiglu")}, {"mla:flashmla@main": 0})
    assert bench_model.select(["deepseek-v3"], "mla:", own) == {"deepseek-v3": ["stock", "mla", "mla:flashmla@main"]}
    assert bench_model.main(out_dir=tmp_path, only="no-such-case", device=torch.device("cpu")) == 2
    assert not list(tmp_path.iterdir())


class FlashMLAAPI:
    """A module with FlashMLA's API over tilefuse's op (its reference path on a CPU), counting calls."""

    def __init__(self):
        import tilefuse

        self.op, self.calls = tilefuse, {"get_mla_metadata": 0, "flash_mla_with_kvcache": 0}

    def get_mla_metadata(self, *args):
        self.calls["get_mla_metadata"] += 1
        return self.op.get_mla_metadata(*args)

    def flash_mla_with_kvcache(self, *args, **kwargs):
        self.calls["flash_mla_with_kvcache"] += 1
        return self.op.flash_mla_with_kvcache(*args, **kwargs)


def test_flashmla_variant_runs_inside_the_same_deepseek_model(tmp_path):
    """An attention module with FlashMLA's API becomes the DeepSeek model's mla:<name> variant: the
    model patched with it decodes (the module called every step), and its greedy tokens are
    compared with tilefuse's mla variant's."""
    fake = FlashMLAAPI()
    assert bench_model.main(out_dir=tmp_path, only="tiny-deepseek", device=torch.device("cpu"),
                            attentions={"mla:fake": fake}) == 0
    data = json.loads(next(tmp_path.glob("model-*.json")).read_text())
    assert data["models"]["tiny-deepseek"]["variants"]["mla:fake"]["attention"] == "fake"
    assert data["attention_peers"] == {"mla:fake": "FlashMLAAPI"}
    rows = [r for r in data["rows"] if r["variant"] == "mla:fake"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 16)]
    assert all("error" not in r and r["agreement_vs_mla"] == 1.0 for r in rows), rows
    assert fake.calls["flash_mla_with_kvcache"] > 0 and fake.calls["get_mla_metadata"] > 0
    with pytest.raises(ValueError, match="attentions"):
        bench_model.main(out_dir=tmp_path, device=torch.device("cpu"), attentions={"fake": fake})


def test_flashmla_rows_speedup_and_goal():
    """tilefuse_speedup = the FlashMLA build's ms / tilefuse's: from the rounds beside the mla model
    (1 / x_mla_paired) where timed so, else from the mla row; the goal judges the graph rows."""
    def row(variant, mode, ms, **extra):
        return {"model": "deepseek-v3", "variant": variant, "mode": mode, "batch": 16, "prompt_tokens": 4096,
                "ms_per_token": ms, **extra}

    rows = [row("stock", "graph", 8.0), row("mla", "graph", 2.0), row("mla", "eager", 4.0),
            row("mla:flashmla@main", "graph", 2.5, x_mla_paired=0.8, mla_ms_paired=2.0),
            row("mla:flashmla@main", "eager", 3.0)]
    ours, theirs = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 0, 4]])
    tokens = {("mla", "graph", 16, 4096): ours, ("mla", "eager", 16, 4096): ours,
              ("mla:flashmla@main", "graph", 16, 4096): theirs, ("mla:flashmla@main", "eager", 16, 4096): ours}
    bench_model.compare(rows, tokens)
    assert rows[3]["tilefuse_speedup"] == 1.25 and rows[3]["agreement_vs_mla"] == 0.75
    assert rows[4]["tilefuse_speedup"] == 0.75 and rows[4]["agreement_vs_mla"] == 1.0
    assert "tilefuse_speedup" not in rows[1]
    summary = bench_model.summarize(rows)
    goal = next(g for g in summary["goals"] if "FlashMLA's inside the same" in g["goal"])
    assert goal["measured"] == 1.25 and goal["met"] is True and goal["cases"] == 1
    assert summary["tilefuse_vs_flashmla"]["deepseek-v3"]["flashmla@main"]["eager b16 4096"] == {
        "tilefuse_speedup": 0.75, "agreement_vs_mla": 1.0}
    assert bench_model.with_peers({"a": ("stock", "mla"), "b": ("stock", "vq2")}, {"mla:x": None}) == {
        "a": ("stock", "mla", "mla:x"), "b": ("stock", "vq2")}


def test_cli_knows_the_model_family(capsys):
    from tilefuse.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "model" in out and "--gguf" in out and "--text" in out and "--layers" in out


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["stock", "swiglu", "vq2"])
def test_cuda_graph_replay_matches_the_eager_step(variant):
    """The captured step replays what the eager step computes: same greedy tokens (exactly for stock;
    the tilefuse kernels' split-K atomics may reorder sums, so near-ties may flip there)."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = hf_models.random_model(config, torch.device("cuda"), torch.bfloat16)
    bench_model.apply_variant(model, variant, None, {})
    for batch in (1, 16):
        prompt = torch.randint(0, 256, (batch, 20), device="cuda")
        eager = hf_decode.GraphDecoder(model, batch, 20 + 16, capture=False).decode(prompt, 16)
        graphed = hf_decode.GraphDecoder(model, batch, 20 + 16, capture=True)
        clock = hf_decode.Clock(torch.device("cuda"), 16)
        first, again = graphed.decode(prompt, 16, clock), graphed.decode(prompt, 16)
        assert graphed.graph is not None and len(clock.intervals_ms()) == 15
        for other in (eager, again):                 # vs the eager step; a second replayed decode
            same = (first == other).float().mean().item()
            assert same == 1.0 if variant == "stock" else same >= 0.9, (variant, batch, same)


def test_texts_read_back_from_a_folder(tmp_path):
    """load_texts takes a folder of calibration.txt and evaluation.txt (what save_texts writes for
    a machine without the `bible` reader) and a single file cut in halves."""
    from tilefuse.bench.hf_models import load_texts
    (tmp_path / "calibration.txt").write_text("in the beginning", encoding="utf-8")
    (tmp_path / "evaluation.txt").write_text("was the word", encoding="utf-8")
    calib, evaluation, where = load_texts(str(tmp_path))
    assert (calib, evaluation) == ("in the beginning", "was the word") and "calibration.txt" in where
    one = tmp_path / "one.txt"
    one.write_text("alpha beta gamma delta", encoding="utf-8")
    calib, evaluation, _ = load_texts(str(one))
    assert calib + evaluation == "alpha beta gamma delta" and calib and evaluation
