#!/usr/bin/env bash
# The seed-27b hybrid in IQ4_XS: make-model on the device, bench_load.py (load time beside
# cat, peak RSS, device bytes of the weights), then an Engine under a 16 GiB budget with the
# arena chosen automatically (a short prompt: the plan and the peak reserved memory).
# ~4 minutes. Writes $OUT/seed_load/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/seed_load"; mkdir -p "$O"
F=/tmp/seed27b.iq4_xs.gguf
cd "$R"
[ -f "$F" ] || { s=$(date +%s); timeout 300 python3 -m kvcompile make-model --arch qwen35 \
    --preset seed-27b --type iq4_xs --out "$F" 2>&1 | tail -3 | tee "$O/make.log";
    echo "make-model $(( $(date +%s) - s )) s" | tee -a "$O/make.log"; }
timeout 120 python3 benchmarks/bench_load.py "$F" --out "$O/load.json" 2>&1 | tee "$O/load.log"
timeout 150 python3 - "$F" <<'PY' 2>&1 | grep -v Warn | tee "$O/engine.log"
import sys, time, torch, kvcompile
e = kvcompile.Engine(sys.argv[1], device="cuda", ctx_size=262144, cache_type_k="q8_0",
                     cache_type_v="q4_0", gpu_memory_gib=16, kv_stream_arena_mib="auto",
                     cuda_graphs=True, progress=False)
print("plan:", e.memory.describe(), flush=True)
r = e.generate("The quick brown fox jumps over the lazy dog. " * 40, max_tokens=16, temperature=0)
print("tokens", r.token_ids, "decode tok/s", round(r.decode_tok_s, 2))
print("max_memory_reserved GiB", torch.cuda.max_memory_reserved() / 2**30)
PY
