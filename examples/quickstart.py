"""Quick start: one call loads the default model (SmolLM2-135M-Instruct, on the CPU unless
you pass device="cuda") and generates a completion.

    python examples/quickstart.py ["your prompt"]
"""
import sys

import kvcompile

prompt = sys.argv[1] if len(sys.argv) > 1 else "The three laws of thermodynamics are"
# temperature=0: greedy, the same text every run; max_tokens bounds the completion
r = kvcompile.generate(prompt, max_tokens=32, temperature=0, progress=False)
print(r.text)
# tokens, time to the first token, prefill / decode tok/s, step times
print(r.stats_line())
