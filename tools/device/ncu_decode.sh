#!/usr/bin/env bash
# Nsight Compute on the transposed decode split (tools/profile/profile_decode_kernel.py):
# stall reasons a SASS line, shared-memory and L1 tables, at NCU_ARGS' shape (default
# 8 x 128, 256K). Writes $OUT/ncu_<tag>_details.txt and $OUT/ncu_<tag>_source.csv.
set -uo pipefail
R=${R:-$(pwd)}
tag=${NCU_TAG:-d128}
cd /tmp
ncu --clock-control none -k regex:_decode_split_t -c 1 --import-source no \
  --section WarpStateStats --section SourceCounters --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
  --section ComputeWorkloadAnalysis --section SpeedOfLight \
  -f -o /tmp/ncu_$tag python3 "$R/tools/profile/profile_decode_kernel.py" ${NCU_ARGS:-} \
  || exit 1
ncu -i /tmp/ncu_$tag.ncu-rep --page details --print-details all > "$OUT/ncu_${tag}_details.txt"
ncu -i /tmp/ncu_$tag.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_${tag}_source.csv"
ls -la "$OUT"
