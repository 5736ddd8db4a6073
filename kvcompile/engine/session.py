"""Session files: an Engine's history (kv/snapshot.py) on disk, to resume a long context in
another process without prefilling it again.

A safetensors file: every KV layer's pages as stored (quantized page formats included), the
token ids, a hybrid's recurrent state and checkpoints; its metadata holds the format
version, the store layout and the model's identity (a digest of its tensors' names, shapes
and types, and the model file's size). Loading checks all three before touching the store.
Writes go to a temporary file in the same folder, are flushed to disk, then renamed over
the target: a crash leaves the previous file whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import torch

from kvcompile.errors import SessionError
from kvcompile.kv.snapshot import History

FORMAT = 1
MAGIC = "kvcompile-session"


def model_identity(model: torch.nn.Module, path: str | None) -> dict:
    """The tensors' names, shapes and types, and the first values of each (two files of
    one geometry differ there), hashed; with the model file's size."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if t is not None:
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.detach().reshape(-1)[:16].cpu().view(torch.uint8).numpy().tobytes())
    return dict(digest=h.hexdigest()[:32],
                file_size=os.path.getsize(path) if path is not None else None)


def save(path: str | os.PathLike, h: History, identity: dict) -> int:
    """Write h to path atomically; returns the bytes written."""
    from safetensors.torch import save_file
    path = Path(path)
    tensors = {f"pages.{i}": p.contiguous() for i, p in h.pages.items()}
    tensors["tokens"] = torch.tensor(h.tokens, dtype=torch.int64)
    if h.state is not None:
        tensors["state.conv"], tensors["state.ssm"] = h.state[0], h.state[1]
    for p, (conv, ssm) in h.checkpoints.items():
        tensors[f"checkpoint.{p}.conv"], tensors[f"checkpoint.{p}.ssm"] = conv, ssm
    meta = dict(format=FORMAT, identity=identity, layout=h.layout,
                rows={str(i): n for i, n in h.rows.items()},
                state_tokens=None if h.state is None else h.state[2])
    # one temporary a writer (process and thread): two saves to one path never share one;
    # the target's name shortened, so the temporary's stays within a file name's 255 bytes
    stem = path.name.encode()[:128].decode(errors="ignore")
    tmp = path.with_name(f".{stem}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={MAGIC: json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)                           # the rename itself is durable
    finally:
        os.close(dir_fd)
    return path.stat().st_size


def load(path: str | os.PathLike, identity: dict, layout: dict) -> History:
    """The history saved at path, checked against this model and store layout."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise SessionError(f"no session file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(MAGIC)
            meta = json.loads(raw) if raw is not None else None
            tensors = {k: f.get_tensor(k) for k in f.keys()} if meta is not None else {}
    except Exception as e:          # safetensors' own errors: a torn or foreign file
        raise SessionError(f"{path} is not a readable session file ({e}); it may be "
                           f"truncated: save the session again") from None
    if meta is None:
        raise SessionError(f"{path} is a safetensors file but not a kvcompile session")
    if not isinstance(meta, dict):
        raise SessionError(f"{path} has session metadata that is not an object; save the "
                           f"session again")
    if not isinstance(meta.get("format"), int) or meta["format"] > FORMAT:
        raise SessionError(f"{path} has session format {meta.get('format')!r}; this "
                           f"kvcompile reads format {FORMAT} and older: upgrade kvcompile")
    if meta.get("identity") != identity:
        raise SessionError(f"{path} was saved from another model ({meta.get('identity')}); "
                           f"this Engine's model is {identity}: load it with that model")
    if meta.get("layout") != layout:
        raise SessionError(f"{path} was saved with another KV layout ({meta.get('layout')}); "
                           f"this Engine has {layout}: use the same cache types and page size")
    try:
        rows = {int(i): n for i, n in meta["rows"].items()}
        state = None
        if meta["state_tokens"] is not None:
            state = (tensors["state.conv"], tensors["state.ssm"], meta["state_tokens"])
        checkpoints = {}
        for k in tensors:
            if k.startswith("checkpoint.") and k.endswith(".conv"):
                p = int(k.split(".")[1])
                checkpoints[p] = (tensors[k], tensors[f"checkpoint.{p}.ssm"])
        return History(tensors["tokens"].tolist(), rows,
                       {i: tensors[f"pages.{i}"] for i in rows}, meta["layout"], state,
                       checkpoints)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SessionError(f"{path} is not a whole session file ({type(e).__name__}: {e}); "
                           f"save the session again") from None
