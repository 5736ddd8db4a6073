"""A chat loop with history: each line you type is a user message; the model's replies stay
in the conversation, so later questions can refer to earlier answers. Ctrl-D ends it.

    python examples/chat.py [--system "You are terse."]
"""
import argparse
import sys

import kvcompile

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--system", default="You are a helpful assistant. Answer briefly.")
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--ubatch-size", type=int, default=256,
                help="prefill chunk; a turn reuses the history before it, cut to a multiple of this")
args = ap.parse_args()

engine = kvcompile.Engine(ctx_size=2048, ubatch=args.ubatch_size, progress=False)
history = [{"role": "system", "content": args.system}]
interactive = sys.stdin.isatty()
while True:
    if interactive:
        print("> ", end="", flush=True)
    line = sys.stdin.readline()
    if not line:                                    # end of input
        break
    if not line.strip():
        continue
    history.append({"role": "user", "content": line.strip()})
    s = engine.stream(messages=history, max_tokens=args.max_tokens, temperature=0)
    reply = "".join(print(p, end="", flush=True) or p for p in s)
    print()
    history.append({"role": "assistant", "content": reply})   # the next turn sees it
    print(s.result.stats_line(), file=sys.stderr)
