"""The docs stay true to the code: docs/api.md lists every public name and command with the
code's signatures, and every relative link in the README and docs/ points at a file that exists."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
SIGNATURE = re.compile(r"`(tilefuse(?:\.\w+)+)(\(.*?\))`")


def plain_signature(obj, drop_first: bool = False) -> str:
    """``inspect.signature`` without annotations (as docs/api.md writes it); ``drop_first`` drops
    ``self`` of a method read from its class."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    params = [p.replace(annotation=inspect.Parameter.empty) for p in params]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def resolve(qualified: str):
    """(object, whether it is a function read from a class) for ``tilefuse.a.B.c``: attributes
    first (``tilefuse.quantizer.quantize`` is the function), submodules where there is none."""
    parts = qualified.split(".")
    owner, obj = None, importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=2):
        try:
            owner, obj = obj, getattr(obj, name)
        except AttributeError:
            owner, obj = obj, importlib.import_module(".".join(parts[:i]))
    return obj, inspect.isclass(owner) and inspect.isfunction(obj)


def public_names() -> list[str]:
    """Every public function, class and module of the package's user-facing namespaces."""
    import tilefuse
    import tilefuse.hf
    import tilefuse.parallel.hf
    import tilefuse.testing

    names = [f"tilefuse.{n}" for n in tilefuse.__all__] + ["tilefuse.parallel.hf"]
    for module in ("nn", "parallel", "quantizer"):
        names += [f"tilefuse.{module}.{n}" for n in importlib.import_module(f"tilefuse.{module}").__all__]
    for module in (tilefuse.hf, tilefuse.parallel.hf):     # what the module's docstring names, and its lazy exports
        said = set(re.findall(r"(?:``|:func:`|:class:`)(\w+)", module.__doc__ or ""))
        names += [f"{module.__name__}.{n}" for n in {*getattr(module, "_PUBLIC", {}), *said} if callable(
            getattr(module, n, None))]
    names += [f"tilefuse.testing.{n}" for n, v in vars(tilefuse.testing).items()
              if inspect.isfunction(v) and v.__module__ == "tilefuse.testing.compare"]
    return sorted(set(names))


def test_every_public_name_is_in_the_api_page():
    text = API.read_text()
    missing = [name for name in public_names() if f"`{name}(" not in text and f"`{name}`" not in text]
    assert not missing, f"docs/api.md lacks {missing}"


def test_every_signature_in_the_api_page_is_the_code_s():
    documented = SIGNATURE.findall(API.read_text())
    assert len(documented) > 40
    wrong = []
    for qualified, written in documented:
        obj, method = resolve(qualified)
        actual = plain_signature(obj, drop_first=method)
        if written != actual:
            wrong.append(f"{qualified}{written}\n  code: {qualified}{actual}")
    assert not wrong, "docs/api.md signatures differ from the code:\n" + "\n".join(wrong)


def test_every_command_and_option_is_in_the_api_page():
    from tilefuse.bench.runner import DEFAULT_OUT, FAMILIES, STANDALONE
    from tilefuse.cli import parser

    text = API.read_text()
    top = parser(tuple(FAMILIES), DEFAULT_OUT, tuple(STANDALONE))
    commands = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction").choices
    missing = []
    for name, sub in commands.items():
        line = next((line for line in text.splitlines() if line.startswith(f"| `tilefuse {name}")), None)
        if line is None:
            missing.append(f"tilefuse {name}")
            continue
        missing += [f"tilefuse {name} {opt}" for action in sub._actions for opt in action.option_strings
                    if opt.startswith("--") and opt != "--help" and opt not in line]
    assert not missing, f"docs/api.md lacks {missing}"


def markdown_files():
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def _ratios(file: str, baselines: tuple[str, ...], keep=lambda params: True) -> list[float]:
    """Per case of a committed result file: the fastest of ``baselines``' graph_us over tilefuse's
    (its default dispatch, the ``tilefuse`` row), CUDA-graph replay."""
    import json

    rows = json.loads((ROOT / "bench" / "results" / file).read_text())["rows"]
    cases = {}
    for row in rows:
        cases.setdefault(json.dumps(row["params"], sort_keys=True), {})[row["impl"]] = row
    out = []
    for key, impls in cases.items():
        ours = impls.get("tilefuse", {}).get("graph_us")
        theirs = [impls[b]["graph_us"] for b in baselines if impls.get(b, {}).get("graph_us")]
        if ours and theirs and keep(json.loads(key)):
            out.append(min(theirs) / ours)
    return out


def _figure(ratios: list[float]) -> str:
    import math

    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{mean:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


FLASHMLA = ("flashmla@b31bfe7", "flashmla@main")
HEADLINES = [      # (file, baselines, which cases, how many of them, the words after the figure)
    ("swiglu-h200.json", ("torch_unfused",), lambda p: True, 56, "faster in {ahead} of {n}"),
    ("swiglu-h200.json", ("torch_merged",), lambda p: True, 56, "faster in {ahead} of {n}"),
    ("swiglu_fp8-h200-quick.json", ("unfused",), lambda p: True, 12, "faster in {ahead} of {n}"),
    ("swiglu-h200.json", ("cublas_gemm",), lambda p: True, 56, ""),
    ("swiglu_fp8-h200-quick.json", ("scaled_mm",), lambda p: True, 12, "faster in {ahead} of {n}"),
    ("vq-h200.json", ("fp16_cublas",), lambda p: p["tokens"] == 1, 16, ""),
    ("vq-h200.json", ("fp16_cublas",), lambda p: p["tokens"] == 64, 16, ""),
    ("vq-h200.json", ("fp16_cublas",), lambda p: p["tokens"] == 512, 16, ""),
    ("vq-h200.json", ("aqlm_cuda",), lambda p: True, 80, ""),
    ("mla-h200-quick.json", FLASHMLA, lambda p: p.get("kv") != "fp8", 29, "ahead in {ahead} of {n}"),
    ("mla-h200-quick.json", FLASHMLA, lambda p: p.get("kv") == "fp8", 7, "ahead in {ahead} of {n}"),
    ("mla-h200-quick-sparse.json", ("flashmla@main",), lambda p: True, 24, "ahead in {ahead} of {n}"),
]


@pytest.mark.parametrize("file, baselines, keep, n, words", HEADLINES, ids=[f"{h[0]}-{h[1][0]}-{i}" for i, h in
                                                                           enumerate(HEADLINES)])
def test_readme_headline_figures_are_the_committed_results(file, baselines, keep, n, words):
    """Each figure of the README's results table is computed from the file it names: graph
    replay, tilefuse's default row against the fastest named peer (MLA: attention alone, its
    metadata planned once). A re-run of the benchmark changes them: copy the new line in."""
    ratios = _ratios(file, baselines, keep)
    assert len(ratios) == n, f"{file}: {len(ratios)} cases against {baselines}, the README counts {n}"
    line = _figure(ratios)
    if words:
        line += ", " + words.format(ahead=sum(r > 1 for r in ratios), n=n)
    readme = (ROOT / "README.md").read_text()
    assert line in readme, f"README.md: expected the figure {line!r} from {file} (against {baselines})"


def test_readme_small_layer_figure_is_the_committed_sweep():
    """The README's small-layer VQ figures: per (N, K, tokens) of each sweep with N x K <= 4096 x
    4096, fp16 cuBLAS's time over that of the kernel the dispatch picks (each kernel was timed in
    the same run), geomean and range at 1-16 tokens on the H200 and the H100, the H100's geomean at
    32 and at 64-128 tokens."""
    import json
    import math

    from tilefuse import _dispatch
    from tilefuse.ops.vq import configs

    readme = " ".join((ROOT / "README.md").read_text().split())
    for name, chip in (("vq-small-h200.json", "H200"), ("vq-small-h100-80gb-hbm3.json", "H100")):
        data = json.loads((ROOT / "bench" / "results" / "sweeps" / name).read_text())
        times = {}
        for row in data["results"]:
            times.setdefault((row["N"], row["K"], row["tokens"]), {})[row["impl"]] = row["us"]
        few, at_32, many = [], [], []
        for (n, k, m), us in times.items():
            if n and n * k <= 4096 * 4096:
                pick = configs.decide(m, n, k, True, _dispatch.CHIPS[chip], data["sms"]).variant
                if pick in us:
                    (few if m <= 16 else at_32 if m == 32 else many).append(us["fp16"] / us[pick])
        line = f"{_figure(few)} fp16 cuBLAS, faster in {sum(r > 1 for r in few)} of {len(few)}"
        assert line in readme, f"README.md: expected {line!r} ({chip})"
        if chip == "H100":
            geomean = lambda rs: f"{math.exp(sum(map(math.log, rs)) / len(rs)):.2f}x"  # noqa: E731
            assert f"{geomean(at_32)} at 32 tokens" in readme and f"stay slower ({geomean(many)})" in readme
    swiglu = json.loads((ROOT / "bench/results/sweeps/vq-swiglu-h100-80gb-hbm3.json").read_text())["results"]
    by_case = {}
    for row in swiglu:
        by_case.setdefault((row["N"], row["K"], row["tokens"]), {})[row["impl"]] = row["us"]
    ratios = [t["swiglu:fused"] / t["swiglu:two_vq"] for (n, k, m), t in by_case.items()
              if n and n * k <= 2 ** 22 and m <= 32]       # the MoE-expert sizes (up to 1408 x 2048)
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x the two projections' time" in readme


@pytest.mark.parametrize("page", ["docs/hf_mla.md"])
def test_doc_examples_run(page):
    """The Python blocks of these pages run as written on a CPU (the reference path)."""
    pytest.importorskip("transformers")
    import tilefuse

    for index, code in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)):
        with tilefuse.force(backend="reference"):
            exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "doc"})


def test_model_page_gives_patch_vq_s_signature():
    import tilefuse.hf

    text = (ROOT / "docs" / "model.md").read_text()
    block = text[text.index("## `tilefuse.hf.patch_vq`"):].split("```")[1]
    missing = [name for name in inspect.signature(tilefuse.hf.patch_vq).parameters if name not in block]
    assert not missing, f"docs/model.md's patch_vq signature lacks {missing}"


def test_every_dotted_tilefuse_name_in_the_docs_exists():
    """``tilefuse.a.b`` in the README, the changelog and docs/ names a module or attribute that
    exists (a renamed or removed function leaves no stale mention)."""
    names = set()
    for page in markdown_files():
        names |= set(re.findall(r"tilefuse(?:\.[A-Za-z_]\w*)+", page.read_text()))
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (AttributeError, ImportError):
            missing.append(name)
    assert not missing, f"the docs name {missing}, which do not exist"


def test_every_public_module_is_in_the_api_page():
    """Every module whose dotted name has no private part is named in docs/api.md (those under
    ``tilefuse.ops`` and ``tilefuse.bench`` by their family and benchmark rows)."""
    import pkgutil

    import tilefuse

    text = API.read_text()
    missing = [m.name for m in pkgutil.walk_packages(tilefuse.__path__, "tilefuse.")
               if not any(part.startswith("_") for part in m.name.split("."))
               and m.name.split(".")[1] not in ("ops", "bench")
               and not re.search(re.escape(m.name) + r"(?![\w.])", text)]
    assert not missing, f"docs/api.md lacks the modules {missing}"
