"""EngineConfig: every option of an Engine in one place, checked once, before the model loads.

`Engine(model, config)` or `Engine(model, **options)` (the options are this dataclass's
fields); `EngineConfig.checked(**options)` refuses an unknown option and every value a typo
can break, with what to change. Options that need the model (ctx_size against its trained
context, the memory budget) are checked against its header right after it is opened.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace

import torch

from kvcompile.engine.dtypes import resolve_dtype
from kvcompile.engine.speculative.options import SpecOptions
from kvcompile.errors import ContextLengthError, DeviceError, KvcompileError
from kvcompile.kv.cuda_backend import COPY_MODES
from kvcompile.kv.host_memory import available_host_bytes
from kvcompile.kv.kv_pages import check_arena_mib
from kvcompile.kv.streamer import decode_depth
from kvcompile.ops.kv_format import kv_type

DEFAULT_CTX_SIZE = 4096


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int | None = None            # None: min(the model's trained context, 4096)
    cache_type_k: str = "f32"              # f32 f16 bf16 q8_0 q4_0
    cache_type_v: str = "f32"
    device: str | None = None              # None: the CPU; cuda, cuda:N
    dtype: str | torch.dtype | None = None  # None / auto: bf16 on CUDA, the CPU's fast path
    # (f32 activations, GGUF weights, C++ kernels); "f32" on the CPU: the reference path
    ubatch: int = 256                      # prefill chunk (tokens a forward)
    kv_stream_arena_mib: float | str = 0   # 0: every page on the device; N MiB; auto
    gpu_memory_gib: float | None = None    # device budget (weights + workspace + KV)
    cuda_graphs: bool | None = None        # None: on for CUDA (the CPU reruns programs)
    compile: bool | None = None            # programs run the traced model; None: = cuda
    cache_prompt: bool = True              # resume at the longest common prefix
    ctx_checkpoints: int = 8               # host copies of a hybrid's recurrent state
    cache_ram_gib: float | None = None     # prompt cache of recent conversations' KV in
    # host RAM (with cache_prompt); None: a quarter of the memory available at the build
    progress: bool = True                  # bars on long loads and prefills (stderr)
    trace: bool = False                    # one stderr line per streamed forward
    threads: int | None = None             # CPU threads; None: the physical cores not busy
    # speculative decoding (llama.cpp's flags)
    spec_type: str = "none"
    spec_ngram_size_n: int = 3
    spec_ngram_size_m: int = 8
    spec_draft_n_max: int = 3
    spec_draft_p_min: float = 0.7
    # streaming: decode's ring depth in layers ("auto": the backend's; "off": prefill's
    # ring), the next forward's fills begun after each one, a captured step filling the
    # next one's first layers, how fills reach the device ("engine": copy engine;
    # "gather": an SM kernel reading pinned memory)
    decode_depth: float | str = "auto"
    prefetch_next: bool | None = None
    fill_ahead: bool | None = None
    stream_copy: str = "engine"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def checked(cls, config: "EngineConfig | None" = None, **options) -> "EngineConfig":
        """`config` with `options` replaced, every value checked."""
        if config is not None and not isinstance(config, EngineConfig):
            raise KvcompileError(f"config must be an EngineConfig (or None), got "
                                 f"{type(config).__name__}; pass options as keywords, e.g. "
                                 f"Engine(model, ctx_size=4096)")
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            near = {u: difflib.get_close_matches(u, cls.names(), n=1, cutoff=0.5) for u in unknown}
            hint = "; ".join(f"{u!r}: did you mean {m[0]!r}?" for u, m in near.items() if m)
            raise KvcompileError(f"unknown Engine option(s) {unknown}{'; ' + hint if hint else ''}"
                                 f"; the options are {', '.join(cls.names())}")
        cfg = replace(config or cls(), **options)
        cfg.check()
        return cfg

    def check(self) -> None:
        kv_type(self.cache_type_k), kv_type(self.cache_type_v)   # KvLayoutError names them
        check_arena_mib(self.kv_stream_arena_mib)
        if self.gpu_memory_gib is not None and not _positive(self.gpu_memory_gib):
            raise KvcompileError(f"gpu_memory_gib (--gpu-memory-gib) must be a positive "
                                 f"number of GiB (or None: the device's free memory), got "
                                 f"{self.gpu_memory_gib!r}")
        if self.ctx_size is not None and not _count(self.ctx_size):
            raise ContextLengthError(f"ctx_size (--ctx-size) must be a positive integer (or "
                                     f"None for the default), got {self.ctx_size!r}")
        if not _count(self.ubatch):
            raise KvcompileError(f"ubatch (-ub / --ubatch-size) must be a positive integer, "
                                 f"got {self.ubatch!r}")
        if not isinstance(self.ctx_checkpoints, int) or isinstance(self.ctx_checkpoints, bool) \
                or self.ctx_checkpoints < 0:
            raise KvcompileError(f"ctx_checkpoints (--ctx-checkpoints) must be an integer >= "
                                 f"0, got {self.ctx_checkpoints!r}")
        if self.cache_ram_gib is not None and not (
                isinstance(self.cache_ram_gib, (int, float)) and
                not isinstance(self.cache_ram_gib, bool) and 0 <= self.cache_ram_gib < 1e6):
            raise KvcompileError(f"cache_ram_gib (--cache-ram) must be a number of GiB >= 0 "
                                 f"(0: no prompt cache; None: a quarter of the available "
                                 f"memory), got {self.cache_ram_gib!r}")
        if self.threads is not None and not _count(self.threads):
            raise KvcompileError(f"threads (--threads) must be a positive integer (or None: "
                                 f"the physical cores other processes leave free), got "
                                 f"{self.threads!r}")
        for name in ("cuda_graphs", "compile", "prefetch_next", "fill_ahead"):
            if getattr(self, name) not in (None, True, False):
                raise KvcompileError(f"{name} must be True, False or None, got "
                                     f"{getattr(self, name)!r}")
        for name in ("cache_prompt", "progress", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise KvcompileError(f"{name} must be True or False, got "
                                     f"{getattr(self, name)!r}")
        decode_depth(self.decode_depth, None)                 # ArenaError says what
        if self.stream_copy not in COPY_MODES:
            raise KvcompileError(f"stream_copy must be one of {COPY_MODES}, got "
                                 f"{self.stream_copy!r}")
        self.spec
        parse_device(self.device)

    @property
    def spec(self) -> SpecOptions:
        return SpecOptions.checked(self.spec_type, self.spec_ngram_size_n,
                                   self.spec_ngram_size_m, self.spec_draft_n_max,
                                   self.spec_draft_p_min)

    def cache_ram_bytes(self) -> int:
        """The prompt cache's budget (0 without cache_prompt)."""
        if not self.cache_prompt:
            return 0
        if self.cache_ram_gib is None:
            return available_host_bytes() // 4
        return int(self.cache_ram_gib * 2**30)

    @property
    def torch_device(self) -> torch.device:
        return parse_device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return resolve_dtype(self.dtype, device)

    def context(self, limit: int) -> int:
        """The context size for a model trained on `limit` tokens."""
        ctx = self.ctx_size or min(limit, DEFAULT_CTX_SIZE)
        if ctx > limit:
            raise ContextLengthError(f"ctx_size (--ctx-size) {ctx} exceeds the model's "
                                     f"trained context of {limit} tokens; use {limit} or less")
        return ctx

    def graphs(self, device: torch.device) -> tuple[bool, bool]:
        """(capture, compile) on `device`: CUDA graphs and traced programs by default on
        CUDA (cuda_graphs=False: traced, uncaptured); on the CPU the eager model, and with
        cuda_graphs=True the traced programs rerun in their fixed layouts."""
        cuda = device.type == "cuda"
        capture = cuda if self.cuda_graphs is None else self.cuda_graphs
        compile = (cuda or capture) if self.compile is None else self.compile
        return capture, compile


def parse_device(device: str | torch.device | None) -> torch.device:
    """The torch device of `device` (None: the CPU); DeviceError if it is not usable here."""
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device {device!r} is not a device name; use cpu or cuda "
                          f"(cuda:N for a GPU other than the first)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("CUDA is not available to this torch build (or no GPU is "
                              "visible): use device cpu (--device cpu), or install a CUDA "
                              "build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: this machine has "
                              f"{torch.cuda.device_count()} GPU(s), cuda:0.."
                              f"cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
