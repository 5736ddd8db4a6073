"""pyproject.toml lists every package folder (setuptools installs only the listed ones: a
folder left out imports from a checkout but not from an installed wheel), and nothing else."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"add to pyproject.toml packages: {sorted(found - listed)}"
    # and a listed package without its folder fails the install (setuptools: "package
    # directory ... does not exist")
    assert listed - found == set(), f"remove from pyproject.toml packages: {sorted(listed - found)}"
