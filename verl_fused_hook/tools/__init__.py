"""Commands shipped with the package (`verl-fused-hook <command>`): the A/B parity check and the benchmarks."""
