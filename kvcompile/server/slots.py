"""Saved sessions over HTTP, in llama.cpp's shape: `POST /slots/0?action=save|restore|erase`
with {"filename": NAME}; files live in --slot-save-path.

A name from a request is a plain file name (no "/", "\\", "..", no leading dot, no control
characters, 1..255 bytes): it cannot leave the session folder. The Engine's
`save_session(path)` / `load_session(path)` do the work, on the Engine's thread.
"""
from __future__ import annotations

import time
from pathlib import Path

from kvcompile.server.api_error import ApiError, invalid

ACTIONS = ("save", "restore", "erase")
MAX_NAME_BYTES = 255


def check_filename(name) -> str:
    """The name if it is a plain file name, else a 400 saying why."""
    if not isinstance(name, str) or not name:
        raise invalid("filename must be a non-empty string (a file name inside "
                      "--slot-save-path)", param="filename", code="invalid_filename")
    why = ("it holds a path separator" if "/" in name or "\\" in name else
           "it holds '..'" if ".." in name else
           "it starts with a dot" if name.startswith(".") else
           "it holds control characters" if any(ord(c) < 32 or ord(c) == 127 for c in name)
           else f"it is over {MAX_NAME_BYTES} bytes" if len(name.encode("utf-8", "replace"))
           > MAX_NAME_BYTES else None)
    if why is not None:
        raise invalid(f"filename {name[:80]!r} is refused: {why}; give a plain file name, "
                      f"the server keeps sessions in its --slot-save-path folder",
                      param="filename", code="invalid_filename")
    return name


def session_path(folder: Path | None, name) -> Path:
    if folder is None:
        raise ApiError(501, "this server saves no sessions: start it with --slot-save-path "
                            "DIR", type="not_supported_error", code="slots_disabled")
    name = check_filename(name)
    path = folder / name
    if path.parent.resolve() != folder.resolve() or path.is_symlink():
        raise invalid(f"filename {name!r} does not name a plain file of the session folder",
                      param="filename", code="invalid_filename")
    return path


def check_slot(slot_id: str, action: str | None) -> None:
    if slot_id != "0":
        raise ApiError(404, f"no slot {slot_id[:40]!r}: this server has one slot, 0",
                       param="id_slot", code="slot_not_found")
    if action not in ACTIONS:
        raise invalid(f"action must be one of {', '.join(ACTIONS)} (?action=...), got "
                      f"{action!r}", param="action", code="invalid_value")


def slot_work(action: str, path: Path | None):
    """work(engine, job) of a slot action; returns the response body (llama.cpp's fields)."""
    def work(engine, job):
        t0 = time.perf_counter()
        if action == "erase":
            engine.store.reset()
            return {"id_slot": 0, "erased": True}
        if action == "save":
            saved = engine.save_session(path)
            out = {"n_saved": saved["tokens"], "n_written": saved["bytes"]}
        else:
            if not path.is_file():
                raise ApiError(404, f"no saved session {path.name!r} in --slot-save-path",
                               param="filename", code="session_not_found")
            out = {"n_restored": engine.load_session(path), "n_read": path.stat().st_size}
        ms = 1e3 * (time.perf_counter() - t0)
        return {"id_slot": 0, "filename": path.name, **out,
                "timings": {f"{action}_ms": round(ms, 3)}}
    return work
