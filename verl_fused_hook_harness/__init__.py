"""The harness beside the runtime: the `verl-fused-hook` commands (A/B parity, benchmarks, train parity),
the tiny models and processes they run, and the CPU stand-ins (named as such) that let megatron-core and
verl run without a GPU. The runtime (`verl_fused_hook`) never imports this package."""
