#!/usr/bin/env bash
# Eager decode step profile (tools/profile/profile_decode.py): 8B geometry, 8K context,
# resident and streaming (256 MiB arena). ~1.5 minutes. Writes $OUT/profile_decode/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/profile_decode"; mkdir -p "$O"
cd /tmp
python3 "$R/tools/profile/profile_decode.py" --out "$O/profile.json" 2>&1 | tee "$O/log.txt"
exit ${PIPESTATUS[0]}
