#!/usr/bin/env bash
# The main job: A/B parity of hook mode against verl's legacy forward on an embedded tiny model (CPU is enough).
# Creates .venv with Python 3.12 and the verl extras first. Extra arguments go to `verl-fused-hook ab-parity`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python="$(ensure_venv verl)"
exec "$python" -m verl_fused_hook_harness.cli ab-parity "$@"
