"""The README's Python examples run as written (on the CPU: the reference path)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index):
    import tilefuse

    code = _python_blocks()[index]
    with tilefuse.force(backend="reference"):      # as on a fresh CPU machine, whatever runs the tests
        exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})


def test_readme_names_every_environment_variable():
    from tilefuse import _env

    text = README.read_text()
    assert all(f"`{name}`" in text for name in _env.VARIABLES)
