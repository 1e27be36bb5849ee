"""Parallel layouts hook mode refuses when the engine is built, because verl's engine cannot train them correctly.

Why at build time: a wrong layout shows up steps later as a gloo abort or, worse,
as hidden states of the wrong micro-batch with plausible losses.

- Interleaved pipelining (VPP) at PP=2 needs `overlap_p2p_comm=True` and
  `batch_p2p_comm=False`, verl's own setting. Without overlap, megatron-core
  (0.19.2) sends both directions to the one neighbour in one call, and its
  shape exchange for variable sequence lengths (always on in verl) posts them in
  an order that swaps the activation's and the gradient's shapes at the peer;
  batched p2p swaps the tensors themselves, whatever the lengths
  (tests/test_pipeline_p2p.py). verl's
  unfused path breaks the same way: hook mode refuses rather than inherit it.
- megatron's EP communication overlap (`overlap_moe_expert_parallel_comm=True`)
  trains through the combined-1F1B schedule, which calls the forward step with
  `return_schedule_plan=True`; verl 0.9.1's `MegatronEngine.forward_step` takes no
  such argument, so verl's training step fails there (TypeError), with or without
  this plugin: verl's own limit, named at start-up instead.
"""

from __future__ import annotations


def unsupported_parallelism(tf_config) -> str | None:
    """Why this TransformerConfig's parallel layout cannot be trained correctly, or None."""
    pp = getattr(tf_config, "pipeline_model_parallel_size", 1) or 1
    vpp = getattr(tf_config, "virtual_pipeline_model_parallel_size", None) or 1
    variable = getattr(tf_config, "variable_seq_lengths", False)
    overlap, batched = getattr(tf_config, "overlap_p2p_comm", False), getattr(tf_config, "batch_p2p_comm", False)
    if pp == 2 and vpp > 1 and (batched or (variable and not overlap)):
        return (
            f"virtual pipeline parallelism (virtual_pipeline_model_parallel_size={vpp}) at "
            f"pipeline_model_parallel_size=2 needs overlap_p2p_comm=True and batch_p2p_comm=False (verl's own "
            f"setting), got overlap_p2p_comm={overlap}, batch_p2p_comm={batched} (variable_seq_lengths={variable}): "
            "megatron-core's interleaved schedule then exchanges both directions with the one neighbour in one "
            "call and swaps the activation's and the gradient's shapes (and with batch_p2p_comm the tensors), so "
            "a stage gets another micro-batch's hidden states; drop those overrides from "
            "override_transformer_config, or use pipeline_model_parallel_size > 2"
        )
    if getattr(tf_config, "overlap_moe_expert_parallel_comm", False):
        return (
            "overlap_moe_expert_parallel_comm=True trains through megatron-core's combined-1F1B schedule, which "
            "calls the forward step with return_schedule_plan=True; verl's MegatronEngine.forward_step takes no such "
            "argument, so verl's training step fails there (TypeError) with or without this plugin; set "
            "overlap_moe_expert_parallel_comm=False in override_transformer_config"
        )
    return None


def refuse_unsupported_parallelism(engine) -> None:
    """Stop the engine build (hook mode) on a layout `unsupported_parallelism` names."""
    reason = unsupported_parallelism(engine.tf_config)
    if reason is not None:
        raise ValueError(f"verl_fused_hook: {reason}")
