#!/usr/bin/env bash
# Runs the whole test suite (CPU): creates .venv with Python 3.12 and the test extras first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python="$(ensure_venv test)"
exec "$python" -m pytest -q "$@"
