#!/usr/bin/env bash
# What tools/device/cpu_smollm2.sh needs that the device lacks, into the ignored .devsnap/:
# the default model's GGUF in two parts (98 MB: a call carries 64 MiB of files) and
# llama-cpp-python's installed package with diskcache (pure Python over its own shared
# libraries, so this machine's build loads on the device's Python too).
# usage (here): tools/device/cpu_payload.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
G=$(.venv/bin/python -c "from kvcompile.io.default_model import default_model_path as p; print(p())")
S=$(.venv/bin/python -c "import llama_cpp, os; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))")
mkdir -p .devsnap
split -n 2 -d "$G" .devsnap/smol.part       # smol.part00, smol.part01
tar czf .devsnap/llama_cpp.tgz -C "$S" llama_cpp diskcache
ls -la .devsnap
