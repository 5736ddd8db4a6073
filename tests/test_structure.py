"""The shape of the code, checked so that it stays true: one class implements the KV store,
CUDA graphs are captured in one module and torch.compile is called in one module, nothing
probes a store or a model with hasattr / getattr-with-a-default, no import cycle (imports
inside functions counted), no module over 400 lines, no loose modules at the top of the
package, few repeated runs of code (`duplicates`), configuration read once."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the source folders and the package each maps to (pyproject.toml's package-dir)
PACKAGES = {"kvcompile": "kvcompile", "ops": "kvcompile.ops", "passes": "kvcompile.passes"}
MAX_LINES = 400
MAX_DUPLICATE_PAIRS = 5


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def calls(path: Path, name: str):
    """Call nodes of `name` (a function name or a dotted attribute chain)."""
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
            yield node


def test_one_class_implements_the_kv_store():
    """What a model may ask of the store (models/contract.py, KvAccess): a class with the
    protocol's methods is a KV store; there is one."""
    stores = []
    for mod, path in MODULES.items():
        for node in ast.walk(tree(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            if any(ast.unparse(b) == "Protocol" for b in node.bases):
                continue
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if {"layer", "check_positions"} <= methods:
                stores.append(f"{mod}.{node.name}")
    assert stores == ["kvcompile.kv.store.KvStore"], stores


@pytest.mark.parametrize("what,patterns,owner", [
    ("CUDA graphs are captured", ("torch.cuda.CUDAGraph", "torch.cuda.graph", "capture_begin"),
     "kvcompile.executor.capture"),
    ("torch.compile is called", ("torch.compile",), "kvcompile.passes.pipeline"),
], ids=["cuda-graph-capture", "torch-compile"])
def test_in_one_module(what, patterns, owner):
    where = set()
    for mod, path in MODULES.items():
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in patterns or name.endswith("." + patterns[-1]):
                    where.add(mod)
    assert where == {owner}, f"{what} in {sorted(where)}"


# hasattr / getattr with a default on objects that are not a store, a cache or a model (a
# library's optional feature, a dataclass's fields, a pass's name): (module, call source)
PROBES_ALLOWED = {
    ("kvcompile.io.gguf.dequant", "getattr(gguf.quants, '_type_traits', {})"),   # gguf's
    ("kvcompile.io.gguf.tensor_stream", "hasattr(os, 'posix_fadvise')"),         # the OS's
    ("kvcompile.passes.checkpoint", "getattr(node.target, '__name__', '')"),     # FX nodes'
    ("kvcompile.passes.pipeline", "getattr(target, '__name__', str(target))"),
    ("kvcompile.passes.pipeline", "getattr(p, 'name', None)"),                   # a pass's
    ("kvcompile.passes.pipeline", "getattr(p, '__name__', None)"),
    ("kvcompile.passes.pipeline", "getattr(e, 'inner_exception', None)"),        # dynamo's
}


def test_nothing_is_probed():
    """Stores and models declare what they offer (KvAccess, StepModel, LayerPlan): no
    hasattr, no getattr with a default, except on the library objects listed."""
    found = []
    for mod, path in MODULES.items():
        for node in ast.walk(tree(path)):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "hasattr" or (name == "getattr" and len(node.args) == 3):
                src = ast.unparse(node)
                if (mod, src) not in PROBES_ALLOWED:
                    found.append(f"{mod}: {src}")
    assert not found, found


def imports_of(mod: str, path: Path) -> set[str]:
    """The package's modules that `mod` imports anywhere (functions included)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                base = ".".join(parent[:len(parent) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """Between modules, counting imports inside functions. A package's __init__ that only
    re-exports counts as the modules it names (importing kvcompile.x.y runs x's __init__,
    but x's __init__ importing y is no dependency of y on x)."""
    graph = {mod: imports_of(mod, path) for mod, path in MODULES.items()}
    for mod, path in MODULES.items():         # a package's own __init__ is not a dependency
        graph[mod] = {m for m in graph[mod] if not (MODULES[m].name == "__init__.py"
                                                    and mod.startswith(m + "."))}
    found = cycles(graph)
    assert not found, found


def test_no_module_over_400_lines():
    long = {mod: n for mod, path in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def test_no_loose_modules_at_the_top():
    """kvcompile/ holds the public API, the CLI and the errors; the rest lives in its
    folders (engine, executor, kv, models, io)."""
    top = sorted(p.name for p in (ROOT / "kvcompile").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "cli.py", "errors.py"], top


def test_configuration_is_read_once():
    """The environment variables that change behaviour are the debug switches, read in one
    module at import (the README lists them); everything else is an EngineConfig field."""
    readers = {mod for mod, path in MODULES.items()
               if re.search(r"os\.environ|os\.getenv", path.read_text(encoding="utf-8"))}
    assert readers <= {"kvcompile.ops.debug", "kvcompile.ops.launching"}, readers
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    switches = re.findall(r'"(KVCOMPILE_[A-Z_]+)"',
                          (ROOT / "ops" / "debug.py").read_text(encoding="utf-8"))
    assert switches and all(s in readme for s in switches), switches


def normalized_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines a duplicate detector looks at: code, white space
    folded; blank lines, comments, docstring-free punctuation and imports left out."""
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        s = " ".join(line.split())
        if not s or s.startswith("#") or s in (")", "]", "}", "):", "]:") or \
                s.startswith(("import ", "from ")):
            continue
        out.append((i, s))
    return out


def exact_duplicate_pairs(min_lines: int = 6) -> set[tuple[str, str]]:
    """Pairs of files (or a file with itself) that share a run of min_lines identical
    normalized lines: a floor of what `duplicates` finds (it matches shapes too)."""
    seen: dict[tuple, tuple[str, int]] = {}
    pairs = set()
    for mod, path in MODULES.items():
        lines = normalized_lines(path)
        for k in range(len(lines) - min_lines + 1):
            run = tuple(s for _, s in lines[k:k + min_lines])
            if run in seen and seen[run] != (mod, k):
                other, _ = seen[run]
                pairs.add(tuple(sorted((mod, other))))
            seen.setdefault(run, (mod, k))
    return pairs


def test_few_repeated_runs_of_code(tmp_path):
    pairs = exact_duplicate_pairs()
    assert len(pairs) <= MAX_DUPLICATE_PAIRS, sorted(pairs)
    tool = shutil.which("duplicates")
    if tool is None:           # (CI has not the tool: the exact-run floor above holds there)
        return
    for folder in PACKAGES:    # outside the checkout: the tool reads what git does not ignore
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([tool, "--repo", str(tmp_path), "--seconds", "60"],
                         capture_output=True, text=True, cwd=tmp_path).stdout
    print(out)
    m = re.search(r"(\d+) pairs? of places", out)
    assert m is not None or out.startswith("no duplicates"), out
    assert m is None or int(m.group(1)) <= MAX_DUPLICATE_PAIRS, out
