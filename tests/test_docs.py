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
