#!/usr/bin/env bash
# Hybrid benchmark (issue 6), quick subset: seed-27b qwen35 geometry (64 layers, 16 of them
# attention), random bf16 weights made on the device (~55 GB), q8_0 K / q4_0 V, context 8K,
# every system (ours and ours-graphs through an arena of 2240 MiB, ours-resident), 8 decode
# steps, plus the short streaming-vs-resident sanity check. Writes
# $OUT/bench_hybrid/{hybrid.json,log.txt}. This subset was not run as such; measured parts on
# one H200: weights 0.3 s, sanity with fla's first autotuning 73 s, an 8K row ~2 s. The full
# table (32K, 128K, 256K) takes further calls: see docs/benchmarks.md, "Hybrid".
# Needs the kvcompile package and the gguf wheel (the lead's preamble installs both, with
# fla-core); whatever is missing is installed here from $R/.whl into /tmp/site.
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/bench_hybrid"
mkdir -p "$D"
cd /tmp    # import the installed package, not the source tree
if ! python3 -c "import kvcompile.ops, gguf, fla, einops" 2>/dev/null; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$R"/.whl/*.whl
    python3 -c "import kvcompile.ops" 2>/dev/null ||
        python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site "$R"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$D/nvidia-smi.txt" 2>&1
python3 "$R/benchmarks/bench_hybrid.py" --quick --out "$D/hybrid.json" 2>&1 | tee "$D/log.txt"
exit "${PIPESTATUS[0]}"
