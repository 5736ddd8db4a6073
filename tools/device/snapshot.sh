#!/usr/bin/env bash
# A device run of one commit, whatever the working tree holds (other sessions' uncommitted
# edits travel with a device call's copy of the tree): `git archive` of the commit into the
# ignored .devsnap/, carried with .whl and unpacked on the device.
# usage (here): tools/device/snapshot.sh [COMMIT]   -> prints the device command's prefix;
# carry [".whl", ".devsnap/src.tgz"] (not all of .devsnap: cpu_payload.sh's files are larger
# than a call carries), then on the device:
#   rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .devsnap/src.tgz -C /tmp/src \
#     && cp -r .whl /tmp/src/ && cd /tmp/src && KVCOMPILE_COMMIT=<c> tools/device/batch.sh ...
set -euo pipefail
cd "$(dirname "$0")/../.."
c=$(git rev-parse --short "${1:-HEAD}")
mkdir -p .devsnap
git archive --format=tar "$c" | gzip > .devsnap/src.tgz
echo "rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .devsnap/src.tgz -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src && KVCOMPILE_COMMIT=$c"
