"""Question answering over a long text file, with the KV history streamed from host memory
through a small arena (what lets a long context run on a GPU that cannot hold its KV).

    python examples/long_text_qa.py TEXT_FILE "question" [--arena-mib 16] [--device cuda]
"""
import argparse
from pathlib import Path

import kvcompile

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("text_file")
ap.add_argument("question")
ap.add_argument("--arena-mib", type=float, default=16,
                help="device memory for KV pages; the rest of the history stays in host RAM")
ap.add_argument("--ctx-size", type=int, default=8192)
ap.add_argument("--device", default=None, help="cpu (default) or cuda")
args = ap.parse_args()

text = Path(args.text_file).read_text(encoding="utf-8")
engine = kvcompile.Engine(
    ctx_size=args.ctx_size, device=args.device,
    cache_type_k="q8_0", cache_type_v="q4_0",     # quantized KV: about a quarter of f16's bytes
    kv_stream_arena_mib=args.arena_mib,           # the KV history streams through this arena
    progress=True)                                # a progress bar over the long prefill
messages = [{"role": "user", "content": f"{text}\n\nAnswer from the text above: {args.question}"}]
for piece in (s := engine.stream(messages=messages, max_tokens=48, temperature=0)):
    print(piece, end="", flush=True)
print()
r = s.result
print(r.stats_line())
if r.kv:                                          # what the streaming did
    print(f"[{r.kv['streamed_fraction']:.0%} of page reads came from the arena's ring, "
          f"{r.kv['h2d_bytes'] / 2**20:.1f} MiB copied host -> device]")
