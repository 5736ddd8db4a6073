#!/usr/bin/env bash
# Streaming benchmark, quick subset: Llama-3-8B geometry, random bf16
# weights made on the device, context 32K, every system (ours streaming + all resident, with
# q8_0/q4_0 and bf16/bf16 KV; transformers DynamicCache() and DynamicCache(offloading=True)).
# Writes $OUT/bench_streaming/{streaming.json,log.txt}. The full table (32K/64K/128K) takes
# several calls of < 10 min each: see docs/benchmarks.md.
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/bench_streaming"
mkdir -p "$D"
cd /tmp    # import the installed package, not the source tree
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$D/nvidia-smi.txt" 2>&1
python3 "$R/benchmarks/bench_streaming.py" --quick --kv q8_0/q4_0,bf16/bf16 \
    --out "$D/streaming.json" 2>&1 | tee "$D/log.txt"
exit "${PIPESTATUS[0]}"
