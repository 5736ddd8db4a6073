"""The report behind `kvcompile info MODEL.gguf`: geometry, storage, KV cost per token.

Reads metadata and tensor infos only; no tensor is dequantized.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from kvcompile.errors import KvLayoutError


def _gguf_listing(path):
    """(config, file_type, [(type name, n_elements, n_bytes)]) of a GGUF file."""
    from kvcompile.io.gguf.arch_config import ARCH_BUILDERS, config_from_metadata
    from kvcompile.io.gguf.reader import open_gguf

    # The report needs a config, which only a supported family has: another one is refused
    # before its vocabulary is decoded.
    f = open_gguf(path, archs=ARCH_BUILDERS)
    cfg = config_from_metadata(f.metadata, f.tensors, path=str(path))
    listing = [(t.ggml_type, t.n_elements, t.n_bytes) for t in f.tensors.values()]
    return cfg, f.metadata.get("general.file_type"), listing


def _hf_listing(path):
    """The same for a Hugging Face folder, from safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    from kvcompile.io.loader import read_config

    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    cfg = read_config(path)
    listing = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                dtype = sl.get_dtype()  # "BF16", "F32", "F16", ...
                bits = int("".join(c for c in dtype if c.isdigit()) or 8)
                listing.append((dtype, n, n * bits // 8))
    return cfg, None, listing


def model_info(path: str | os.PathLike) -> dict:
    from kvcompile.io.weights import is_hf_checkpoint
    from kvcompile.ops.kv_format import KV_TYPES, bytes_per_token   # torch: not at import

    if is_hf_checkpoint(path) and Path(path).exists():
        cfg, file_type, listing = _hf_listing(path)
    else:
        cfg, file_type, listing = _gguf_listing(path)
    counts, type_bytes, type_params = Counter(), Counter(), Counter()
    for type_name, n_elements, n_bytes in listing:
        counts[type_name] += 1
        type_bytes[type_name] += n_bytes
        type_params[type_name] += n_elements
    quant_types = {name: {"tensors": counts[name], "bytes": type_bytes[name],
                          "params": type_params[name]}
                   for name in sorted(counts, key=lambda n: -type_bytes[n])}
    # Layers that hold a KV cache (hybrid families have recurrent layers without one).
    kv_layers = sum(1 for i in range(cfg.n_layers) if cfg.is_attention_layer(i))
    kv_per_token = {}
    for name, t in KV_TYPES.items():
        try:  # K and V pages, every attention layer
            kv_per_token[name] = 2 * kv_layers * bytes_per_token(t, cfg.n_kv_heads, cfg.head_dim)
        except KvLayoutError:
            kv_per_token[name] = None
        if t.quantized and cfg.head_dim % 32:
            kv_per_token[name] = None
    return {
        "path": str(path),
        "file_bytes": _disk_bytes(Path(path)),
        "architecture": cfg.arch,
        "name": cfg.name,
        "file_type": file_type,
        "layers": cfg.n_layers,
        "kv_layers": kv_layers,
        "hidden": cfg.hidden,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn": cfg.ffn,
        "vocab": cfg.vocab_size,
        "context_length": cfg.context_length,
        "rope": {"theta": cfg.rope_theta, "dim": cfg.rotary_dim,
                 "layout": "neox" if cfg.rope_neox else "adjacent pairs",
                 "scaling": dict(cfg.rope_scaling)},
        "rms_eps": cfg.rms_eps,
        # (window, windowed layers) of sliding-window attention, None without
        "sliding_window": ((cfg.sliding_window, sum(1 for i in range(cfg.n_layers)
                                                    if cfg.layer_window(i)))
                           if cfg.sliding_window else None),
        "tie_embeddings": cfg.tie_embeddings,
        "tensor_count": len(listing),
        "quant_types": quant_types,
        "params": sum(type_params.values()),
        "param_bytes": sum(type_bytes.values()),
        "kv_bytes_per_token": kv_per_token,
    }


def _disk_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size


def format_bytes(n: int) -> str:
    """A byte count in the largest binary unit under 1024 (2.40 MiB), as info and
    make-model print it."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def format_count(n: int) -> str:
    """A parameter count in thousands, millions or billions (4.5 M, 1.23 B)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def format_model_info(info: dict) -> str:
    rope = info["rope"]
    lines = [
        f"model          {info['path']} ({format_bytes(info['file_bytes'])})",
        f"architecture   {info['architecture']}" + (f"  ({info['name']})" if info["name"] else ""),
        f"layers         {info['layers']}" + (f" ({info['kv_layers']} with KV cache)"
                                              if info["kv_layers"] != info["layers"] else ""),
        f"hidden         {info['hidden']}",
        f"heads          {info['heads']} query, {info['kv_heads']} KV, head dim {info['head_dim']}",
        f"ffn            {info['ffn']}",
        f"vocab          {info['vocab']}" + ("  (tied input/output embeddings)"
                                             if info["tie_embeddings"] else ""),
        f"context        {info['context_length']}",
        f"rope           theta {rope['theta']:g}, {rope['dim']} dims, {rope['layout']}"
        + (f", scaling {rope['scaling']}" if rope["scaling"] else ""),
        *([f"window         {info['sliding_window'][0]} positions on "
           f"{info['sliding_window'][1]} of {info['layers']} layers"]
          if info["sliding_window"] else []),
        f"parameters     {format_count(info['params'])} in {info['tensor_count']} tensors, "
        f"{format_bytes(info['param_bytes'])}",
        "tensor types   " + ", ".join(
            f"{name} x{q['tensors']} ({format_bytes(q['bytes'])})"
            for name, q in info["quant_types"].items()),
        "KV per token   (K + V, all layers)",
    ]
    for name, b in info["kv_bytes_per_token"].items():
        if b is None:
            lines.append(f"  {name:<6} not available for head dim {info['head_dim']}")
        else:
            per_k = b * 1024
            lines.append(f"  {name:<6} {b:>8} B   {format_bytes(per_k):>11} per 1K tokens   "
                         f"{format_bytes(per_k * 128):>11} per 128K")
    return "\n".join(lines)


def format_gguf_metadata(path: str | os.PathLike) -> str | None:
    """What a GGUF's header says, whatever its architecture (for `info` on a file the
    engine cannot run): its metadata keys (arrays as their length) and its tensor types.
    None when `path` is not a GGUF file."""
    from kvcompile.io.gguf.header import read_header
    from kvcompile.io.weights import is_hf_checkpoint
    if is_hf_checkpoint(path):
        return None
    h = read_header(path)
    types = Counter()
    for t in h.tensors:
        types[t.ggml_type] += t.n_bytes
    lines = [f"file          {h.path} ({format_bytes(h.file_size)}, GGUF v{h.version})",
             f"tensors       {len(h.tensors)}" + "".join(
                 f", {name} {format_bytes(n)}" for name, n in types.most_common())]
    for key, value in h.metadata.items():
        if isinstance(value, list):
            value = f"[{len(value)} values]"
        lines.append(f"{key:40s} {value}")
    return "\n".join(lines)
