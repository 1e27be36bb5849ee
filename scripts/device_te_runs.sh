#!/usr/bin/env bash
# Issue 44's runs on one H200 with Transformer Engine: the TE layer spec as verl builds it (mbridge and
# Megatron-Bridge), measured end to end. One device call a step, at most 9 minutes each; steps 1-4 ran on 2026-12-05
# (about 20 minutes with the machine's start), 5 and 6 in a later session that day (7 and 6.5 minutes, start
# included), 7 and 8 in a third (3.6 and 2.4 minutes). What each measures, and the figures it gave:
# docs/benchmarks.md, "Transformer Engine (H200; H100 rows)".
#
# Here (with network), once:  bash scripts/device_wheels.sh && bash scripts/device_te.sh pack
#                             (step 6: bash scripts/device_fa3.sh pack/build/keep; step 7: device_apex.sh pack)
# Each call: run with carry [".whl", "build/te"] (and build/fa3 for step 6, build/apex for step 7) and the command
# `bash scripts/device_te_runs.sh STEP...` (several steps share one call's 530 s). .whl (20 MiB with megatron-energon's
# wheels) and build/te (42 MiB) fill most of a call's 64 MiB: step 6 (build/fa3, 3 MiB more) goes in a call of its own.
# Step 8 carries build/apex and build/fa3 as well, over 64 MiB: its call on 2026-12-05 moved
# build/te/wheels/nvidia_cudnn_frontend-*.whl (11.6 MB) aside first (TE imports that package only for its flex
# attention and grouped MLP; only a fresh build of TE's extension, not needed with its .so.xz in build/te, might).
# build/te is git-ignored: after a fresh `pack` it has no prebuilt extension, and step 1 compiles it (1 min 41 s on
# the H200's 16 cores) and hands it back as $OUT/transformer_engine_torch-*.so.xz: copy that file into build/te
# before the next call, so that later calls only unpack it (`device_te.sh keep`).
#
#   step 1 (~4 min): doctor; ab-parity on the TE spec (verl's kernel both sides: identical; vs verl's unfused path
#                    within bf16 tolerance), its MTP and padded (BSHD) scenarios; the --batch-invariant and
#                    --grad-accum-fusion refusals as the device gives them
#   step 2 (~5 min): train-parity on the TE spec, Qwen2.5-0.5B shapes (24 layers): 4 GRPO steps, checkpoint, resume
#   step 3 (~6.5 min): e2e-bench, Qwen2.5-7B shapes at 28 layers with full recompute, TE and local spec in the same
#                    rounds, every mode and the decoder alone (the output layer's share), 4k/16k/32k tokens
#   step 4 (~4 min): e2e-bench, Qwen2.5-0.5B shapes (24 layers), the same at 4k-64k tokens; the loss inside the op
#                    on the TE spec (7B shapes, 28 layers, 16k tokens)
#   step 5 (~7 min): step 3 at 64k tokens
#   step 6 (~6 min): megatron's batch_invariant_mode with FlashAttention 3 (carry build/fa3 too: its fa3_site.tar.xz
#                    from `scripts/device_fa3.sh build` and `keep`): FA3's smoke check, ab-parity on the TE spec
#                    under the mode, and train-parity with the old log-probs in micro-batches of 2 and the update
#                    in 5: every step exactly on-policy (actor/ppo_kl and actor/pg_clipfrac 0)
#   step 7 (~6 min): megatron's gradient_accumulation_fusion on the TE spec (carry build/apex too: its apex_src.tar.xz
#                    from `scripts/device_apex.sh pack`; the first call builds apex's fused_weight_gradient_mlp_cuda,
#                    ~1 min, and hands it back as $OUT/fused_weight_gradient_mlp_cuda-torch*.so.xz: copy it into
#                    build/apex): its smoke check, then step 3's 7B run at 16k tokens with the weight gradients going
#                    into DDP's fp32 main_grad
#   step 8 (~4 min): train-parity on the TE spec built through Megatron-Bridge (verl 0.9.1's default builder;
#                    steps 1-7 build through mbridge): 2 GRPO steps, legacy / hook-verl / hook-auto-fused-loss.
#                    Carry build/apex (with step 7's prebuilt extension) and build/fa3 too: Megatron-Bridge turns
#                    on gradient_accumulation_fusion where TE imports (the output layer then needs apex), and
#                    verl's Megatron-Bridge build sets attention_backend=flash (TE then needs a FlashAttention)
#   step 9 (~7 min): issue 55's full-depth columns on another card (the H100, 2026-12-07): step 3 at 16k and 32k
#                    tokens, legacy / hook+verl / hook+ours+mask, the decoder alone timed too; the results' names
#                    end in the card. With the repository at 4.5 MB, .whl and build/te pass 64 MiB: move
#                    build/te/wheels/nvidia_cudnn_frontend-*.whl aside first, as for step 8 (H100, 2026-12-08: 343 s
#                    with TE's build)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_steps.sh
source scripts/device_steps.sh

setup() {
    install_wheels
    bash scripts/device_te.sh install || exit 1
    if [ ! -f /tmp/te_build.done ]; then  # no prebuilt extension for this torch in build/te: compile, hand it back
        bash scripts/device_te.sh build > "$OUT/te_build.log" 2>&1 || { tail -n 40 "$OUT/te_build.log"; exit 1; }
        bash scripts/device_te.sh keep "$OUT"
        echo "built the TE extension; copy $OUT/$(ls "$OUT" | grep '\.so\.xz$') into build/te for later calls"
    fi
    # shellcheck disable=SC1091
    source /tmp/te_env.sh
    python3 -c "import transformer_engine, transformer_engine_torch as tex; print('transformer_engine', \
transformer_engine.__version__, 'cuDNN', tex.get_cudnn_version())" || exit 1
}

QWEN7B=verl_fused_hook_harness/configs/qwen2_5_7b_2layer
QWEN05B=verl_fused_hook_harness/configs/qwen2_5_0_5b
E2E=(--warmups 1 --repeats 2 --modes legacy,hook+verl,hook+ours,hook+ours+mask)

step1() {
    run 90 doctor
    run 150 ab-parity --device cuda --tp 1 --layer-spec te --dtype bf16 --json "$OUT/ab_te.json"
    run 120 ab-parity --device cuda --tp 1 --layer-spec te --dtype bf16 --mtp-layers 1 --json "$OUT/ab_te_mtp.json"
    run 120 ab-parity --device cuda --tp 1 --layer-spec te --dtype bf16 --layout bshd --json "$OUT/ab_te_bshd.json"
    run 60 ab-parity --device cuda --tp 1 --layer-spec te --batch-invariant  # refused: FlashAttention 3/4 missing
    run 60 e2e-bench --layer-spec te --grad-accum-fusion  # refused: apex's fused_weight_gradient_mlp_cuda missing
}

step2() {
    run 500 train-parity --device cuda --layer-spec te --steps 4 --prompts 2 --n 5 --prompt-lengths 32,128 \
        --response-lengths 64,256 --micro-batch 5 --offload off --modes legacy,hook-verl,hook-auto-fused-loss \
        --out "$OUT/train_parity_te"
}

step3() {
    run 520 e2e-bench --hf-config "$QWEN7B" --layers 28 --recompute --layer-specs local,te --output-layer-share \
        --sizes 4096,16384,32768 "${E2E[@]}" --out "$OUT/e2e_7b"
}

step4() {
    run 300 e2e-bench --hf-config "$QWEN05B" --layer-specs local,te --output-layer-share \
        --sizes 4096,16384,32768,65536 "${E2E[@]}" --out "$OUT/e2e_0_5b"
    run 200 e2e-bench --fused-loss --layer-spec te --hf-config "$QWEN7B" --layers 28 --recompute --sizes 16384 \
        --warmups 1 --repeats 2 --out "$OUT/e2e_7b_fused_loss"
}

step5() {
    run 530 e2e-bench --hf-config "$QWEN7B" --layers 28 --recompute --layer-specs local,te --output-layer-share \
        --sizes 65536 "${E2E[@]}" --out "$OUT/e2e_7b_64k"
}

step6() {
    # FlashAttention 3 here only: where it imports TE may prefer it to cuDNN's attention, so steps 1-5 run without it
    # its own folder, on PYTHONPATH in this step only (steps run in subshells): a later step or call on the same
    # machine does not see it
    bash scripts/device_fa3.sh install /tmp/fa3_site build/fa3/fa3_site.tar.xz || return 1
    export PYTHONPATH="/tmp/fa3_site:$PYTHONPATH"
    run_command 60 bash scripts/device_fa3.sh smoke
    run 150 ab-parity --device cuda --tp 1 --layer-spec te --dtype bf16 --batch-invariant --json "$OUT/ab_te_invariant.json"
    run 300 train-parity --device cuda --layer-spec te --batch-invariant --steps 2 --no-resume --prompts 2 --n 5 \
        --prompt-lengths 32,128 --response-lengths 64,256 --micro-batch 5 --old-log-prob-micro-batch 2 --offload off \
        --modes legacy,hook-verl,hook-auto-fused-loss --out "$OUT/train_parity_te_invariant"
}

step7() {
    local prebuilt
    prebuilt=$(ls build/apex/fused_weight_gradient_mlp_cuda-torch*.so.xz 2>/dev/null | head -n1)
    bash scripts/device_apex.sh install /tmp/apex_site build/apex || return 1
    [ -n "$prebuilt" ] || bash scripts/device_apex.sh keep "$OUT"
    run_command 60 bash scripts/device_apex.sh smoke /tmp/apex_site
    # shellcheck disable=SC1091
    source /tmp/apex_env.sh
    run 400 e2e-bench --hf-config "$QWEN7B" --layers 28 --recompute --layer-spec te --grad-accum-fusion \
        --sizes 16384 "${E2E[@]}" --out "$OUT/e2e_7b_grad_accum_fusion"
}

step8() {
    bash scripts/device_apex.sh install /tmp/apex_site build/apex || return 1
    # shellcheck disable=SC1091
    source /tmp/apex_env.sh
    bash scripts/device_fa3.sh install /tmp/fa3_site build/fa3/fa3_site.tar.xz || return 1
    export PYTHONPATH="/tmp/fa3_site:$PYTHONPATH"
    run 300 train-parity --device cuda --layer-spec te --bridge megatron-bridge --steps 2 --no-resume --prompts 2 \
        --n 5 --prompt-lengths 32,128 --response-lengths 64,256 --micro-batch 5 --offload off \
        --modes legacy,hook-verl,hook-auto-fused-loss --out "$OUT/train_parity_te_megatron_bridge"
}

step9() {
    local card
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[12]00' | tr 'H' 'h')
    run 520 e2e-bench --hf-config "$QWEN7B" --layers 28 --recompute --layer-specs local,te --output-layer-share \
        --sizes 16384,32768 --warmups 1 --repeats 2 --modes legacy,hook+verl,hook+ours+mask --out "$OUT/e2e_7b_$card"
    rm -f "$OUT"/*/*.png
}

# One or more steps per call (`8 7`): they share the call's LIMIT seconds, and a command without time left is skipped.
[ $# -gt 0 ] || set -- ""
for step in "$@"; do
    case "$step" in
    1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9) ;;
    *)
        echo "usage: $0 STEP... (1-9; see the top of this file)" >&2
        exit 2
        ;;
    esac
done
setup
for step in "$@"; do
    "step$step" 2>&1 | tee "$OUT/step$step.log"
done
