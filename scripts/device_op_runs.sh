#!/usr/bin/env bash
# The op's device runs: the GPU tests, and the benchmarks a card's column needs (issue 55: every figure per card,
# one run per card). Steps 3-8 are the earlier runs whose files results/README.md lists, kept as their commands;
# a card's run today is steps 1, 9 and 2, one call each.
#
# Here (with network), once:  bash scripts/device_wheels.sh
#                             mkdir -p build/ab && git archive f29c1ef verl_fused_hook > build/ab/f29c1ef.tar
# Each call: carry [".whl", "build/ab"] and run `bash scripts/device_op_runs.sh STEP...` (several steps share one call's
# time); results come back in $OUT, their names ending in the card (h100, h200).
#
#   step 1 (~5 min): the op's GPU tests (kernels, the Gluon forward, batch invariance, token_log_probs, replay,
#                    main_grad, the fused loss), then `doctor` (its forward-kernel and invariance lines)
#   step 2 (~8 min): the engine-level GPU tests (ab-parity, BSHD, MTP, e2e parity, tensor parallelism, train-parity)
#   step 3 (~5 min): the batch-invariant op against f29c1ef (the per-N layout) in rounds: the cost, <= 1% wanted
#   step 4 (~8 min): forward_kl_topk and sum pi^2 from hidden states against verl's paths, k = 128 and 32, at 16k,
#                    64k and 128k tokens (issue 43's targets: <= 1.15x the four-GEMM floor, sum pi^2 <= 1.1x a GEMM)
#   step 5 (~8 min): a distillation actor update in verl's engine (forward_kl_topk, then k3 inside the op)
#   step 6 (~6 min): token_log_probs as top-k distillation calls it (k teacher ids, own top k), the working tree
#                    against main in rounds, k = 128 and 32, 16k and 64k tokens. For a branch that changes the op:
#                    here `git archive main verl_fused_hook > build/ab/main.tar`, then run from the branch.
#   step 7 (~2 min): where token_log_probs' top-k forward spends its time (torch.profiler), k = 128 and 32, at 16k and
#                    64k tokens (results/EXPERIMENTS.md, "Group maxima from the forward kernel": 64k, k = 128)
#   step 8 (~5 min): the top-k chunk budget (token_log_probs' top_k_chunk_bytes) at 2 and 4 GiB against the default
#                    1 GiB, k = 128, in rounds with each step's peak memory. The base is the same code: here
#                    `git archive HEAD verl_fused_hook > build/ab/main.tar` first. (`bench --top-k-chunk-bytes`
#                    reads it against the floor in one run: 4 GiB gave no gain, EXPERIMENTS.md.)
#   step 9 (~6 min): issue 55's figures on this card: its six shapes, ours and verl's kernel against the four-GEMM
#                    floor and the no-grad forward against one GEMM; kl_topk and sum pi^2 at k = 32, 64 and 128,
#                    16k and 64k tokens (targets: 1.05x the floor; the forward 1.08x one GEMM from 4096 rows)
#   step 10 (~8 min): a branch that changes token_log_probs' top-k (distillation, replay), before it lands: here
#                    `git archive main verl_fused_hook > build/ab/main.tar`, then from the branch: its GPU tests
#                    (token_log_probs, replay, batch invariance), the A/B against main at k = 128 and 32, kl_topk and
#                    sum pi^2 at k = 128 against the floor, and where the backward's time goes at 65536 tokens
#   step 11 (~3 min): the accuracy table's 16384-row column on this card (ours, into main_grad, verl against fp64)
#   step 12 (~5 min): the other models and layouts on this card (benchmarks.md "Other models and layouts"): the MoE
#                    shapes, the padded layout and one MTP layer against verl as it ships, 2 layers each (on the
#                    H100, 2026-12-08, only its MoE run and the padded layout at 16k and 32k tokens ran, by hand, in
#                    what was left of the session's device time: results/README.md)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_steps.sh
source scripts/device_steps.sh

# the tests new since the last H200 run first: a call cut at its limit has run them
OP_TESTS=(test_gluon_forward test_batch_invariance_cuda test_selected_tokens_cuda test_replay_cuda test_main_grad_cuda
    test_fused_loss_cuda test_triton_backend test_triton_chunk_kernels test_triton_label_is_max test_torch_backend_cuda
    test_autocast_cuda test_verl_backend_cuda)
# Its tests read the CUDA caching allocator's state, so they run in a process of their own: after the modules above
# in one process (H200, 2026-12-05) the cache held 1.0-1.4 GB free pieces they cannot place their segments around.
MEMORY_TESTS=test_fused_loss_memory_cuda
ENGINE_TESTS=(test_ab_parity_cuda test_ab_parity_mtp_cuda test_bshd_cuda test_e2e_mtp_cuda test_e2e_parity
    test_parallel_cuda test_train_parity_cuda)
DISTILL_SHAPES="16384,4096,151936;65536,4096,151936;131072,4096,151936"
DISTILL_METHODS=floor,kl_topk,verl_kl_topk,verl_kl_topk_chunked,sum_pi_squared
ISSUE55_SHAPES="24576,3584,152064;12288,5120,152064;49152,4096,128256;4096,4096,151936;2048,3584,152064;1024,4096,151936"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$CARD" in
*H200*) CARD=h200 ;;
*H100*) CARD=h100 ;;
*) CARD=gpu ;;
esac

gpu_tests() {
    local name=$1 seconds=$2
    shift 2
    run_command "$seconds" python3 -m pytest -v -p no:cacheprovider -rs --durations=10 --junitxml "$OUT/$name.xml" \
        "${@/#/tests/gpu/}"
}

step1() {
    gpu_tests "gpu_op_tests_$CARD" 400 "${OP_TESTS[@]/%/.py}"
    gpu_tests "gpu_memory_tests_$CARD" 60 "$MEMORY_TESTS.py"
    run 60 doctor
}

step2() {
    gpu_tests "gpu_engine_tests_$CARD" 520 "${ENGINE_TESTS[@]/%/.py}"
}

step3() {
    local base=(--base f29c1ef)
    [ -d .git ] || base+=(--base-archive build/ab/f29c1ef.tar)
    run_command 520 python3 scripts/ab_op_revisions.py "${base[@]}" --new-options '{"batch_invariant": true}' \
        --out "$OUT/ab_batch_invariance.json"
}

step4() {
    local k
    for k in 128 32; do
        run 260 bench --shapes "$DISTILL_SHAPES" --methods "$DISTILL_METHODS" --topk "$k" --warmup 1 --repeats 3 \
            --accuracy-shape '' --out "$OUT/bench_distill_k$k"
    done
}

step5() {
    run 330 e2e-bench --distillation forward_kl_topk --topk 128 --sizes 8192,16384,32768,65536 --warmups 2 \
        --repeats 3 --out "$OUT/e2e_distillation"
    run 190 e2e-bench --distillation k3 --sizes 16384,65536 --warmups 1 --repeats 3 --out "$OUT/e2e_distillation_k3"
}

step6() {
    local base=(--base main) k
    [ -d .git ] || base+=(--base-archive build/ab/main.tar)
    for k in 128 32; do
        run_command 170 python3 scripts/ab_op_revisions.py "${base[@]}" --topk "$k" --rounds 5 \
            --shapes "16384,4096,151936;65536,4096,151936" --out "$OUT/ab_kl_topk_k$k.json"
    done
}

step7() {
    local n
    for n in 16384 65536; do
        run_command 150 python3 scripts/profile_token_log_probs.py --shape "$n,4096,151936" \
            --out "$OUT/profile_kl_topk_exact_$n.json"
    done
}

step8() {
    local base=(--base main) bytes
    [ -d .git ] || base+=(--base-archive build/ab/main.tar)
    for bytes in 2147483648 4294967296; do
        run_command 170 python3 scripts/ab_op_revisions.py "${base[@]}" --topk 128 --rounds 5 \
            --new-options "{\"top_k_chunk_bytes\": $bytes}" --shapes "16384,4096,151936;65536,4096,151936" \
            --out "$OUT/ab_kl_topk_chunk_bytes_$bytes.json"
    done
}

step9() {
    local k
    run 220 bench --shapes "$ISSUE55_SHAPES" --methods floor,triton,verl --warmup 1 --repeats 3 --accuracy-shape '' \
        --out "$OUT/bench_issue55_$CARD"
    for k in 32 64 128; do
        run 100 bench --shapes "16384,4096,151936;65536,4096,151936" --methods floor,kl_topk,sum_pi_squared \
            --topk "$k" --warmup 1 --repeats 3 --accuracy-shape '' --out "$OUT/bench_distill_k${k}_$CARD"
    done
}

step10() {
    local base=(--base main) k
    [ -d .git ] || base+=(--base-archive build/ab/main.tar)
    gpu_tests "gpu_tests_top_k_$CARD" 200 test_selected_tokens_cuda.py test_replay_cuda.py test_batch_invariance_cuda.py
    for k in 128 32; do
        run_command 100 python3 scripts/ab_op_revisions.py "${base[@]}" --topk "$k" --rounds 3 \
            --shapes "16384,4096,151936;65536,4096,151936" --out "$OUT/ab_top_k_k${k}_$CARD.json"
    done
    run 90 bench --shapes "16384,4096,151936;65536,4096,151936" --methods floor,kl_topk,sum_pi_squared --topk 128 \
        --warmup 1 --repeats 3 --accuracy-shape '' --out "$OUT/bench_distill_k128_$CARD"
    run_command 80 python3 scripts/profile_token_log_probs.py --shape 65536,4096,151936 --topk 128 --backward \
        --sum-pi-squared --out "$OUT/profile_kl_topk_backward_65536_$CARD.json"
    rm -f "$OUT"/*.png  # a call brings back a handful of files: the data, not the plots
}

step11() {
    run 180 bench --quick --shapes 1024,4096,151936 --methods triton,triton_main_grad,verl --warmup 1 --repeats 1 \
        --accuracy-shape 16384,4096,151936 --out "$OUT/bench_accuracy_16384_$CARD"
    rm -f "$OUT"/*.png
}

step12() {
    run 100 e2e-bench --moe --sizes 8192 --modes legacy,hook+verl,hook+ours+mask --warmups 1 --repeats 2 \
        --out "$OUT/e2e_moe_$CARD"
    run 200 e2e-bench --layout bshd --sizes 16384,32768,65536 --warmups 1 --repeats 2 --out "$OUT/e2e_bshd_$CARD"
    run 200 e2e-bench --mtp 1 --sizes 16384,32768,65536 --warmups 1 --repeats 2 --out "$OUT/e2e_mtp_$CARD"
    rm -f "$OUT"/*/*.md "$OUT"/*/*.png
}

# One or more steps per call (`3 4`): they share the call's LIMIT seconds, and a command without time left is skipped.
[ $# -gt 0 ] || set -- ""
for step in "$@"; do
    case "$step" in
    1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 | 11 | 12) ;;
    *)
        echo "usage: $0 STEP... (1-12; see the top of this file)" >&2
        exit 2
        ;;
    esac
done
install_wheels
for step in "$@"; do
    "step$step" 2>&1 | tee "$OUT/step$step.log"
done
