#!/usr/bin/env bash
# tools/profile/timeline_streamed.py on the device: a replayed streamed decode step of the 8B
# geometry (TL_CTX, default 64K, through a 2048 MiB arena) under torch.profiler and cProfile.
# Writes $OUT/timeline/{timeline.json,host_profile.txt,log.txt}.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/timeline"; mkdir -p "$O"
cd /tmp
timeout ${TL_LIMIT:-200} python3 "$R/tools/profile/timeline_streamed.py" --ctx ${TL_CTX:-65536} \
    --out /tmp/tl 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp /tmp/tl/timeline.json /tmp/tl/host_profile.txt "$O/" 2>/dev/null
exit $rc
