# Sourced by the device run scripts (device_op_runs.sh, device_te_runs.sh): what every step of a device call does.
# A call is cut at 600 s, so a step's commands share LIMIT seconds and a command that would start without time
# left is skipped, saying so, rather than cut off mid-way with nothing written.
OUT="${OUT:?run on the device machine: its results go to \$OUT}"
LIMIT=530  # seconds a step's commands may take together
STARTED=$(date +%s)
export PYTHONUNBUFFERED=1

# The carried wheels (scripts/device_wheels.sh) into /tmp/site, with the ray stand-in and the checkout importable.
install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD/scripts/device_stubs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

# `run_command SECONDS COMMAND...`: COMMAND with what is left of the step's time (at most SECONDS), timed.
run_command() {
    local budget=$(( LIMIT - ($(date +%s) - STARTED) ))
    [ "$budget" -gt "$1" ] && budget=$1
    shift
    if [ "$budget" -lt 30 ]; then
        echo "SKIPPED (no time left in this call): $*"
        return
    fi
    echo "=== $* (at most ${budget}s)"
    local start
    start=$(date +%s)
    timeout "$budget" "$@"
    echo "=== exit $? after $(( $(date +%s) - start ))s"
}

# `run SECONDS ARGS...`: `verl-fused-hook ARGS...` the same way.
run() {
    local seconds=$1
    shift
    run_command "$seconds" python3 -m verl_fused_hook_harness.cli "$@"
}
