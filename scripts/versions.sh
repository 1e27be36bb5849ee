#!/usr/bin/env bash
# Keeps the declared version bounds honest: builds a fresh venv per column of the tested matrix (docs/usage.md,
# "Tested versions") under build/versions/NAME, installs this checkout into it, then runs the demo, `doctor` and
# the verl-facing tests there. Each column's summary goes to build/versions/NAME/summary.txt.
#
#   bash scripts/versions.sh               # both columns: lower, then newest
#   bash scripts/versions.sh lower         # the oldest releases pyproject.toml allows
#   bash scripts/versions.sh newest        # no pins: whatever the index serves today
#   REUSE_VENVS=1 bash scripts/versions.sh # rerun in the venvs already built (this checkout is installed editable)
#
# Not part of .ci/run: each column downloads torch with its CUDA libraries (~3.5 GB) and the tests take ~15 minutes
# a column on 2 cores. The newest column ignores this machine's pip configuration (PIP_CONFIG_FILE=/dev/null): a
# constraints file there caps torch below the newest release.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
source scripts/env.sh

# The oldest releases pyproject.toml allows (keep in step with its dependencies and docs/usage.md).
LOWER_PINS=("torch==2.8.*" "megatron-core==0.19.0" "verl==0.9.1" "mbridge[megatron]==0.15.1")
# The verl-facing subset: the switch, the hook and its probe, A/B parity, the op, distillation, exact on-policy,
# train parity with checkpoint and resume, pipeline parallelism, MTP; the process launcher (gloo's lines on torch 2.8).
TESTS=(
    tests/test_switch.py tests/test_hook.py tests/test_probe.py tests/test_ab_parity.py tests/test_op.py
    tests/test_distillation.py tests/test_exact_on_policy.py tests/test_train_parity.py
    tests/test_pipeline_parallel.py tests/test_mtp.py tests/test_process_launcher.py
)

build_column() {
    local venv="$root/build/versions/$1"
    shift
    if [ "${REUSE_VENVS:-0}" = 1 ] && [ -x "$venv/bin/python" ]; then
        return 0
    fi
    rm -rf "$venv"
    "$(find_python312)" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$@" "$venv/bin/python" -m pip install --quiet -e "$root[test]" "${pins[@]}"
}

run_column() {
    local name="$1" venv="$root/build/versions/$1" python summary status=0
    python="$venv/bin/python"
    summary="$venv/summary.txt"
    {
        echo "column: $name, $(date -u +%Y-%m-%d), commit $(git describe --always --dirty)"
        "$python" -m pip list 2>/dev/null | grep -i -E '^(torch|megatron-core|verl|mbridge|transformers|triton) '
    } > "$summary"
    if "$python" -m verl_fused_hook_harness.cli ab-parity > "$venv/demo.out" 2>&1; then
        echo "demo: PASS, $(wc -l < "$venv/demo.out") lines of output, $(grep -c 'peer ranks' "$venv/demo.out") of gloo's" \
            >> "$summary"
    else
        echo "demo: FAIL (see $venv/demo.out)" >> "$summary"
        status=1
    fi
    if VERL_FUSED_USE_OP_HOOK=1 "$python" -m verl_fused_hook_harness.cli doctor > "$venv/doctor.out" 2>&1; then
        echo "doctor: OK" >> "$summary"
    else
        echo "doctor: FAIL (see $venv/doctor.out)" >> "$summary"
        status=1
    fi
    "$python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$venv/tests.out" 2>&1 || status=1
    echo "tests: $(tail -n 1 "$venv/tests.out")" >> "$summary"
    cat "$summary"
    return "$status"
}

columns=("$@")
[ "${#columns[@]}" -eq 0 ] && columns=(lower newest)
overall=0
for column in "${columns[@]}"; do
    case "$column" in
        lower) pins=("${LOWER_PINS[@]}"); build_column lower env ;;
        newest) pins=(); build_column newest env PIP_CONFIG_FILE=/dev/null ;;
        *) echo "error: unknown column '$column' (lower or newest)" >&2; exit 2 ;;
    esac
    run_column "$column" || overall=1
done
exit "$overall"
