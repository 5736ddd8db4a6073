"""Speculative decoding with ngram drafts: text that repeats earlier text (a quote of the
prompt, code, a list) is proposed from its earlier occurrence and verified in one forward;
the output is exactly what plain greedy decoding gives, in fewer forwards. A model with an
MTP (NextN) layer, such as a Qwen3.5 GGUF that keeps it, can draft with that layer instead:
spec_type="draft-mtp" (spec_draft_n_max tokens a round, 3), or "ngram-simple,draft-mtp".

    python examples/speculative.py [--max-tokens 48]
"""
import argparse

import kvcompile

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--max-tokens", type=int, default=48)
args = ap.parse_args()

text = ("Shipping forecast: wind west four or five, sea moderate, rain later, good "
        "occasionally poor. ") * 3
prompt = text + "Repeat the forecast once more: Shipping forecast:"
results = {}
for spec in ("none", "ngram-simple"):
    # n: tokens of the lookup key, m: most tokens a draft proposes
    engine = kvcompile.Engine(None, ctx_size=1024, progress=False, spec_type=spec,
                              spec_ngram_size_n=3, spec_ngram_size_m=8)
    results[spec] = r = engine.generate(prompt, max_tokens=args.max_tokens, temperature=0)
    print(f"--spec-type {spec}: {r.text!r}")
    print(r.stats_line())
same = results["none"].token_ids == results["ngram-simple"].token_ids
s = results["ngram-simple"].speculative
print(f"same tokens: {same}; {s['forwards']} verify forwards for "
      f"{results['ngram-simple'].completion_tokens - 1} tokens after the first")
