"""The one entry point for model weights: a GGUF file or a Hugging Face checkpoint folder.

Whatever the source, tensors come back keyed by GGUF names (`token_embd.weight`,
`blk.{i}.attn_q.weight`, ...) in PyTorch layout [out, in], with a ModelConfig that says
how to interpret them (notably `rope_neox` for the Q/K row layout).
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvcompile.io.default_model import default_model_path
from kvcompile.io.loaded_weights import LoadedWeights


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() or p.name == "config.json" or p.suffix == ".safetensors"


def load_weights(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 progress: bool = True, device: str | torch.device = "cpu",
                 keep_quantized: bool | None = None, opened=None) -> LoadedWeights:
    """Load a .gguf file or a Hugging Face folder (config.json + *.safetensors). GGUF
    tensors land on `device` ready for the model (weight_plan); HF tensors on the host."""
    path = Path(path if path is not None else default_model_path())
    if is_hf_checkpoint(path):
        from kvcompile.io.hf_checkpoint import load_hf_checkpoint
        return load_hf_checkpoint(path, dtype=dtype, progress=progress)
    return load_gguf_weights(path, dtype=dtype, progress=progress, device=device,
                             keep_quantized=keep_quantized, opened=opened)


def load_gguf_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      progress: bool = True, device: str | torch.device = "cpu",
                      keep_quantized: bool | None = None, opened=None) -> LoadedWeights:
    """Read a GGUF model tensor by tensor straight into place on `device` (weight_plan
    says what each becomes): host memory stays at a few staging chunks (tensor_stream),
    device memory at the weights plus one chunk. `opened`: the file's parsed header
    (reader.GgufFile), when the caller has it."""
    from kvcompile.io.gguf.arch_config import ARCH_BUILDERS, config_from_metadata
    from kvcompile.io.gguf.dequant import check_dequantizable
    from kvcompile.io.gguf.reader import open_gguf
    from kvcompile.io.gguf.tensor_stream import TensorStream

    device = torch.device(device)
    t0 = time.perf_counter()
    # another family is refused before its vocabulary is read
    f = opened if opened is not None else open_gguf(path, archs=ARCH_BUILDERS)
    header_s = time.perf_counter() - t0
    config = config_from_metadata(f.metadata, f.tensors, path=str(path))
    for info in f.tensors.values():
        check_dequantizable(info.name, info.ggml_type)
    plan = weight_plan(f.tensors.values(), device, dtype, keep_quantized)
    warn_dequantized(plan)
    offsets, total = layout(plan)
    store = torch.empty(total, dtype=torch.uint8, device=device)   # every weight, one buffer
    tensors = {}
    bar = tqdm(total=sum(p.info.n_bytes for p in plan), desc=f"loading {Path(path).name}",
               unit="B", unit_scale=True, disable=not progress, file=sys.stderr, leave=False)
    stream = TensorStream(path, device)
    t1 = time.perf_counter()
    with bar, stream:
        for p in plan:          # file order: sequential reads
            at = offsets[p.info.name]
            tensors[p.info.name] = _read(stream, p, store[at:at + p.device_bytes], bar)
        t2 = time.perf_counter()
    # setup: the plan, the device buffer (the first CUDA call creates the context) and the
    # pinned staging buffers; finish: the last copies and the readers' shutdown
    seconds = dict(header=header_s, setup=t1 - t0 - header_s, loop=t2 - t1,
                   finish=time.perf_counter() - t2, read=stream.read_seconds,
                   wait=stream.wait_seconds)
    return LoadedWeights(config=config, tensors=tensors, metadata=f.metadata, source="gguf",
                         seconds=seconds)


# Projections the models fuse into one matrix (layers.fuse_linears): the loader puts their
# parts back to back, so the fused weight is a view and costs no memory.
FUSED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"),
         ("ffn_gate.weight", "ffn_up.weight"))
ALIGN = 256


def layout(plan: list["PlannedWeight"]) -> tuple[dict[str, int], int]:
    """Byte offset of each planned tensor in the one weight buffer, and its size: members
    of a FUSED group back to back (in group order), everything else ALIGN-aligned."""
    by_name = {p.info.name: p for p in plan}
    offsets, at = {}, 0
    for p in plan:
        name = p.info.name
        if name in offsets:
            continue
        group = [name]
        prefix, leaf = _split_block(name)
        for names in FUSED:
            if leaf in names:
                group = [g for g in (f"{prefix}{n}" for n in names) if g in by_name]
                break
        at = -(-at // ALIGN) * ALIGN
        for g in group:
            offsets[g] = at
            at += by_name[g].device_bytes
    return offsets, -(-at // ALIGN) * ALIGN


def _split_block(name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('blk.3.', 'attn_q.weight'); others: ('', name)."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk":
        return f"blk.{parts[1]}.", parts[2]
    return "", name


@dataclass
class PlannedWeight:
    info: object                  # gguf.reader.TensorInfo
    quantized: bool               # kept in its block format (QuantWeight)
    dtype: torch.dtype            # else: the dense dtype it is read into
    no_kernel: bool = False       # a block type without a qlinear kernel, dequantized

    @property
    def device_bytes(self) -> int:
        if self.quantized:
            from kvcompile.ops.qlinear.formats import weight_format
            rows, cols = _rows_cols(self.info.shape)
            return rows * weight_format(self.info.ggml_type).planar_row_bytes(cols)
        return self.info.n_elements * self.dtype.itemsize


def dense_dtype(name: str, shape: tuple, dtype: torch.dtype) -> torch.dtype:
    """Vectors (norms, biases, recurrent decays) and the GDN conv kernel stay fp32, as GGUF
    stores them and llama.cpp applies them; matrices take the model's dtype."""
    return torch.float32 if len(shape) == 1 or name.endswith("ssm_conv1d.weight") else dtype


def weight_plan(infos, device: torch.device, dtype: torch.dtype,
                keep_quantized: bool | None = None) -> list[PlannedWeight]:
    """What each tensor becomes on `device`. keep_quantized (default: on CUDA with f16 /
    bf16 activations; the CPU's fast path asks for it) keeps every matrix whose type has a
    qlinear kernel on the device in its GGUF block format, except F16 / BF16 matrices of
    the activations' own dtype (dense: cuBLAS and the gemv op read them as they are);
    others are dequantized into their dense dtype."""
    from kvcompile.ops.qlinear.cpu_kernel import CPU_FORMATS
    from kvcompile.ops.qlinear.formats import FORMATS
    if keep_quantized is None:
        keep_quantized = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    cuda = device.type == "cuda"
    plan = []
    for info in infos:
        target = dense_dtype(info.name, info.shape, dtype)
        kernel = info.ggml_type in (FORMATS if cuda else CPU_FORMATS)
        same_dense = {"F16": torch.float16, "BF16": torch.bfloat16}.get(info.ggml_type) == target
        keep = (keep_quantized and kernel and len(info.shape) == 2 and target == dtype
                and not same_dense)
        no_kernel = (keep_quantized and cuda and not kernel and len(info.shape) == 2
                     and info.ggml_type not in ("F32", "F16", "BF16"))
        plan.append(PlannedWeight(info, keep, target, no_kernel))
    return plan


def warn_dequantized(plan: list[PlannedWeight]) -> None:
    """One warning naming the tensors whose block type has no kernel (dequantized)."""
    slow = [p for p in plan if p.no_kernel]
    if not slow:
        return
    types = sorted({p.info.ggml_type for p in slow})
    extra = sum(p.device_bytes - p.info.n_bytes for p in slow)
    names = ", ".join(p.info.name for p in slow[:4]) + (" ..." if len(slow) > 4 else "")
    warnings.warn(f"{len(slow)} tensor(s) ({names}) are stored as {'/'.join(types)}, which has "
                  f"no GPU kernel: they are dequantized to {slow[0].dtype} at load, "
                  f"{extra / 2**30:.2f} GiB more than in the file; a file in Q4_K, Q6_K, "
                  f"Q8_0 or IQ4_XS (among others) stays quantized", stacklevel=3)


def _rows_cols(shape: tuple) -> tuple[int, int]:
    """A tensor as rows of its last dimension (vectors: one row)."""
    return math.prod(shape[:-1]), shape[-1]


def _read(stream, p: PlannedWeight, place: torch.Tensor, bar):
    """One tensor, chunk by chunk, into its place (uint8 bytes of the weight buffer)."""
    from kvcompile.ops.qlinear.formats import FORMATS, to_planar, weight_format
    from kvcompile.ops.qlinear.triton_kernel import dequant_rows_triton
    from kvcompile.models.quant_weight import QuantWeight
    info, device = p.info, place.device
    rows, cols = _rows_cols(info.shape)
    row_bytes = info.n_bytes // rows
    if p.quantized:
        out = place.view(rows, -1)
    else:
        out = place.view(p.dtype).view(rows, cols)
    on_device = info.ggml_type in FORMATS and device.type == "cuda"
    for r0, chunk in stream.row_chunks(info.data_offset, rows, row_bytes):
        n = chunk.shape[0]
        if p.quantized:
            to_planar(chunk.to(device, non_blocking=True), info.ggml_type, cols,
                      out=out[r0:r0 + n])
        elif info.ggml_type in _FLOAT_VIEWS:
            vals = chunk.view(_FLOAT_VIEWS[info.ggml_type])
            out[r0:r0 + n].copy_(vals.to(device, non_blocking=True))
        elif on_device:       # a kernel type read dense (f32 activations): dequantize there
            planar = to_planar(chunk.to(device, non_blocking=True), info.ggml_type, cols)
            dequant_rows_triton(planar, info.ggml_type, cols, torch.arange(n, device=device),
                                p.dtype, out=out[r0:r0 + n])
        else:
            vals = _dequantize_host(info, chunk)
            out[r0:r0 + n].copy_(vals.view(n, cols).to(device, non_blocking=True))
        bar.update(n * row_bytes)
    if p.quantized:
        return QuantWeight(out, weight_format(info.ggml_type).name, (rows, cols))
    return out.view(info.shape)


_FLOAT_VIEWS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _dequantize_host(info, chunk: torch.Tensor) -> torch.Tensor:
    import gguf
    from kvcompile.io.gguf.dequant import dequantize_tensor
    qtype = gguf.GGMLQuantizationType[info.ggml_type]
    return torch.from_numpy(dequantize_tensor(info.name, chunk.numpy(), qtype))
