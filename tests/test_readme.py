"""The README's Python snippets run as written (CPU, the default model)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)


def test_readme_python_snippets_run(capsys):
    blocks = snippets()
    assert blocks, "the README has no ```python block"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "tok/s" in out and "first token after" in out
