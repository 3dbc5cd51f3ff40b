#!/usr/bin/env bash
# After scripts/device_train.sh: FILES_AT (the device call's files) -> DRAFT_DIR (default /tmp/device-draft):
# the trained draft (model.safetensors joined from its parts, config.json, MODEL_CARD.md) and every stage's log.
set -euo pipefail
from=$1
to=${2:-/tmp/device-draft}
mkdir -p "$to/logs"
tar -xzf "$from/results.tar.gz" -C "$to/logs"
cp "$from/log.txt" "$from"/*.json "$to/logs/" 2>/dev/null || true
if ls "$from"/model.safetensors.part* >/dev/null 2>&1; then
    cat "$from"/model.safetensors.part* >"$to/model.safetensors"
    cp "$to/logs/config.json" "$to/logs/MODEL_CARD.md" "$to/"
fi
ls -la "$to" "$to/logs"
