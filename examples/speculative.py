"""Speculative decoding with ngram drafts: text that repeats earlier text (a quote of the
prompt, code, a list) is proposed from its earlier occurrence and verified in one forward;
the output is exactly what plain greedy decoding gives, in fewer forwards. A model with an
MTP (NextN) layer, such as a Qwen3.5 GGUF that keeps it, can draft with that layer instead:
spec_type="draft-mtp" (spec_draft_n_max tokens a round, 3), or "ngram-simple,draft-mtp".

    python examples/speculative.py [--max-tokens 48] [--model FILE] [--device cuda]
        [--spec-type draft-mtp] [--spec-draft-p-min 0.7]
"""
import argparse

import kvcompile

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
ap.add_argument("--spec-type", default="ngram-simple",
                help="ngram-simple, draft-mtp or ngram-simple,draft-mtp")
ap.add_argument("--spec-draft-p-min", type=float, default=0.7,
                help="draft-mtp drafts while its top token is at least this likely")
args = ap.parse_args()

text = ("Shipping forecast: wind west four or five, sea moderate, rain later, good "
        "occasionally poor. ") * 3
prompt = text + "Repeat the forecast once more: Shipping forecast:"
results = {}
for spec in ("none", args.spec_type):
    # n: tokens of the lookup key, m: most tokens a draft proposes
    engine = kvcompile.Engine(args.model, ctx_size=1024, device=args.device, progress=False,
                              spec_type=spec, spec_ngram_size_n=3, spec_ngram_size_m=8,
                              spec_draft_p_min=args.spec_draft_p_min)
    results[spec] = r = engine.generate(prompt, max_tokens=args.max_tokens, temperature=0)
    print(f"--spec-type {spec}: {r.text!r}")
    print(r.stats_line())
spec = results[args.spec_type]
s = spec.speculative
print(f"same tokens: {results['none'].token_ids == spec.token_ids}; {s['forwards']} verify "
      f"forwards for {spec.completion_tokens - 1} tokens after the first")
