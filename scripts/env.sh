#!/usr/bin/env bash
# Creates (or refreshes) the project's Python 3.12 virtual environment in .venv with
# the given extras, then prints the environment's python. Sourced by demo.sh and test.sh.
set -euo pipefail

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/"3.12*/bin/python3.12)" /usr/bin/python3.12 /usr/local/bin/python3.12; do
        for path in $candidate; do
            if [ -n "$path" ] && "$path" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
                echo "$path"
                return 0
            fi
        done
    done
    echo "error: Python 3.12 not found; install it or set PYTHON312=/path/to/python3.12" >&2
    return 1
}

ensure_venv() {
    local extras="$1" root venv stamp wanted
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    if [ ! -x "$venv/bin/python" ]; then
        "$(find_python312)" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
    fi
    stamp="$venv/.installed-$extras"
    wanted="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
        "$venv/bin/python" -m pip install --quiet -e "$root[$extras]" >&2
        echo "$wanted" > "$stamp"
    fi
    echo "$venv/bin/python"
}
