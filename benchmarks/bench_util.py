"""Small helpers the device benchmarks share: a timestamped log line, the commit and date every
result row records, a device sync for timing, freeing device memory between systems, event
timing, the HBM bandwidth and the model benchmarks' common options. The measurements
themselves go through the Engine (or the Executor's own steps), never a loop of these."""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch


def add_run_options(ap, results: str, merge: bool = True, tiny_temp: bool = True) -> None:
    """The options bench_streaming, bench_hybrid and bench_compiled end with: the sanity
    check and --fresh (`merge`: the script merges rows into --out), the seed, the PCIe
    probe's size, and --out (default `results`; `tiny_temp`: a temp file under --tiny)."""
    if merge:
        ap.add_argument("--no-sanity", action="store_true")
        ap.add_argument("--fresh", action="store_true", help="start --out afresh (default: merge)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pcie-mib", type=int, default=1024)
    ap.add_argument("--out", default=None,
                    help=f"default {results}" + (" (tiny: a temp file)" if tiny_temp else ""))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_meta() -> dict:
    """What every result row records: the git commit (KVCOMPILE_COMMIT, which the device
    scripts pass since the device's copy has no .git, else `git rev-parse`), the UTC date,
    the device and torch."""
    import datetime
    import subprocess
    commit = os.environ.get("KVCOMPILE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc)
                .strftime("%Y-%m-%dT%H:%M:%SZ"), device=device, torch=torch.__version__)


@contextlib.contextmanager
def kernel_compiles():
    """The Triton kernels compiled inside the block (the process's cache misses), by name: a
    measured request should compile none (a compile inside a time to first token is a
    kernel that specializes on an argument a warm-up did not vary)."""
    import triton
    runtime = triton.knobs.runtime
    names: list[str] = []
    before = runtime.jit_cache_hook

    def hook(*, fn, **kw):
        names.append(fn.name)
        return before(fn=fn, **kw) if before else None
    runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        runtime.jit_cache_hook = before


def commit_date() -> dict:
    """run_meta's commit and date alone (a row that names its device itself)."""
    meta = run_meta()
    return dict(commit=meta["commit"], date=meta["date"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def param_bytes(model) -> int:
    """Bytes of a model's weights (parameters and quantized `qweight` buffers), each storage
    once (fused projections keep their parts as views of one weight: counting parameters
    would count those bytes twice)."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("qweight"))]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in tensors}
    return sum(storages.values())


def events_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def hbm_bandwidth() -> dict:
    n = 1 << 30                                   # 2 GiB of bf16
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_()
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 2 / (events_ms(lambda: y.copy_(x), 20) * 1e-3) / 1e9
    read = x.numel() * 2 / (events_ms(lambda: x.sum(dtype=torch.float32), 20) * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return {"copy_gbps": copy, "read_gbps": read, "hbm_gbps_measured": max(copy, read)}
