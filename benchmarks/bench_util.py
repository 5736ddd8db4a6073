"""Small helpers the device benchmarks share: a timestamped log line, a device sync for
timing, freeing device memory between systems, a timed prefill + greedy decode, event timing,
the HBM bandwidth, the probes' JSON and the model benchmarks' common options."""
from __future__ import annotations

import gc
import json
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


def timed_prefill_decode(prefill, decode, ctx: int, n_warm: int, n_steps: int, device,
                         after_warm=None) -> dict:
    """Time `prefill()` (returns the first token), then `decode(token, position, n)` (returns
    n greedy tokens): `n_warm` untimed steps (captures, compiles), `after_warm()` if given
    (e.g. marking telemetry), then `n_steps` timed ones. All under inference_mode.
    Returns prefill_s, decode_s, the first 8 tokens after the prefill's, warm_steps."""
    with torch.inference_mode():
        sync(device)
        t = time.perf_counter()
        first = prefill()
        sync(device)
        prefill_s = time.perf_counter() - t
        warm = decode(first, ctx, n_warm)
        if after_warm is not None:
            after_warm()
        sync(device)
        t = time.perf_counter()
        toks = decode(warm[-1], ctx + n_warm, n_steps)
        sync(device)
        decode_s = time.perf_counter() - t
    return dict(prefill_s=prefill_s, decode_s=decode_s, decode_tokens=(warm + toks)[:8],
                warm_steps=n_warm)


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


def write_rows(path: str | None, hbm_gbps: float, rows: list) -> None:
    """A probe's rows and the HBM bandwidth measured beside them, as JSON at `path` (if any)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(hbm_gbps=hbm_gbps, rows=rows), f, indent=1)
