"""Loading a GGUF onto the GPU: time beside `cat FILE > /dev/null` in the same call, peak
host RSS of the loading process, device bytes of the weights beside the file's tensor bytes.

    python benchmarks/bench_load.py FILE [FILE ...] [--out PATH]

Each load runs in a fresh child process (its peak RSS: resource.getrusage of the children,
the one before it being `cat`) through kvcompile.io.loader.load_model(device="cuda"), timed
to GPU completion. The process's start-up (importing torch and kvcompile's ops, creating the
CUDA context: paid once a process, whatever the file) is timed apart as startup_s. Targets
(issue 25): weights <= 1.05 x the file's tensor bytes, peak RSS <= 3 GiB + the largest
tensor, load time <= 2 x the cat time. Rows record the git commit and date.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import log, run_meta  # noqa: E402

GIB = 1 << 30
CHILD = r"""
import cProfile, io, json, pstats, sys, time
t = time.perf_counter()
import torch
import kvcompile.ops  # the custom ops' registration imports torch._dynamo
from kvcompile.io.loader import load_model
dev, profile = sys.argv[2], sys.argv[3] == "1"
if dev == "cuda":
    torch.empty(1, device=dev)          # the CUDA context
startup_s = time.perf_counter() - t
prof = cProfile.Profile() if profile else None
t = time.perf_counter()
prof and prof.enable()
m = load_model(sys.argv[1], device=dev, dtype=torch.bfloat16, progress=False)
if dev == "cuda":
    torch.cuda.synchronize()
load_s = time.perf_counter() - t
if prof:
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue(), file=sys.stderr)
tensors = [*m.model.parameters(), *m.model.buffers()]
weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in tensors}.values())
print(json.dumps(dict(load_s=load_s, startup_s=startup_s, parts_s=m.seconds, device_weight_bytes=weights, max_reserved=
                      torch.cuda.max_memory_reserved() if dev == "cuda" else 0)))
"""


def measure(path: str, device: str, profile: bool = False) -> dict:
    from kvcompile.io.gguf.reader import open_gguf
    infos = open_gguf(path).tensors.values()
    tensor_bytes = sum(i.n_bytes for i in infos)
    largest = max(i.n_bytes for i in infos)
    t = time.perf_counter()
    subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True)
    cat_s = time.perf_counter() - t
    proc = subprocess.run([sys.executable, "-c", CHILD, path, device, str(int(profile))],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    if profile:
        print(proc.stderr, file=sys.stderr)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    row = dict(file=os.path.basename(path), file_bytes=os.path.getsize(path),
               tensor_bytes=tensor_bytes, largest_tensor_bytes=largest, cat_s=cat_s, **child,
               device=device, peak_rss_bytes=rss,
               weights_over_file=child["device_weight_bytes"] / tensor_bytes,
               rss_budget_bytes=3 * GIB + largest, load_over_cat=child["load_s"] / cat_s)
    row["ok"] = (row["weights_over_file"] <= 1.05 and rss <= row["rss_budget_bytes"]
                 and row["load_over_cat"] <= 2.0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--device", default="cuda", help="cuda (the target) or cpu (a smoke run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print the load's cProfile (cumulative), which slows it a little")
    args = ap.parse_args()
    meta, rows = run_meta(), []
    for path in args.files:
        row = dict(measure(path, args.device), **meta)
        if args.profile:
            measure(path, args.device, profile=True)
        rows.append(row)
        log(f"{row['file']}: load {row['load_s']:.1f} s vs cat {row['cat_s']:.1f} s "
            f"({row['load_over_cat']:.2f}x); weights {row['device_weight_bytes'] / GIB:.2f} GiB "
            f"= {row['weights_over_file']:.3f} x file tensors; peak RSS "
            f"{row['peak_rss_bytes'] / GIB:.2f} GiB (limit {row['rss_budget_bytes'] / GIB:.2f})"
            f"; ok={row['ok']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
