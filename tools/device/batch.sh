#!/usr/bin/env bash
# Run device scripts from one call: install the carried wheels and this checkout into
# /tmp/site, then each named tools/device/<name>.sh (in parallel with -p: correctness runs
# share the GPU fine, timings do not), each logging to $OUT/<name>.log.
# usage (device, repo root): KVCOMPILE_COMMIT=<commit> tools/device/batch.sh [-p] name [name ...]
set -uo pipefail
export R=$(pwd) PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
export PYTHONUNBUFFERED=1   # piped logs show how far a run that a time limit cut got
par=0; [ "${1:-}" = "-p" ] && { par=1; shift; }
# the device's copy has no .git: result rows take their commit from here
[ -n "${KVCOMPILE_COMMIT:-}" ] || { echo "set KVCOMPILE_COMMIT (git rev-parse --short HEAD) in the call"; exit 2; }
export KVCOMPILE_COMMIT
t0=$(date +%s)
# a warm machine keeps /tmp/site: pip --target does not replace what is there
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . \
  || { echo "install failed"; exit 2; }
echo "installed in $(( $(date +%s) - t0 )) s"
declare -A pids
for n in "$@"; do
  if [ $par = 1 ]; then
    ( s=$(date +%s); bash "$R/tools/device/$n.sh" > "$OUT/$n.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$OUT/$n.log" ) &
    pids[$n]=$!
  else
    s=$(date +%s); bash "$R/tools/device/$n.sh" > "$OUT/$n.log" 2>&1; echo "rc $? in $(( $(date +%s) - s )) s" >> "$OUT/$n.log"
  fi
done
wait
for n in "$@"; do echo "== $n: $(tail -1 "$OUT/$n.log")"; done
