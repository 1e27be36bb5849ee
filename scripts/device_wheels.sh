#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels the GPU device machine lacks, for the device tool's `carry`.
# That machine has torch, triton and transformers but no network; these are what verl-fused-hook e2e-bench,
# ab-parity --device cuda, bench's peers and tests/gpu import there (megatron-bridge: train-parity --bridge
# megatron-bridge; with Transformer Engine present its package imports with these alone, checked here with TE
# faked; verl's make_megatron_module also imports its training config, which imports megatron-energon: on the H200
# the build stopped there, 2026-12-05; energon and what its import needs beyond the device's own packages follow).
# On the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl, then
# PYTHONPATH=/tmp/site:$PWD/scripts/device_stubs:$PWD (the ray stand-in; see scripts/device_stubs/README.md).
# verl's kernel for `verl-fused-hook bench` is then at /tmp/site/verl/utils/kernel (--verl-kernel-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python="${PYTHON:-.venv/bin/python}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    megatron-core==0.19.2 verl==0.9.1 mbridge==0.15.1 omegaconf==2.3.1 hydra-core==1.3.8 tensordict==0.10.0 \
    codetiming==1.4.0 pyvers==0.1.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 orjson==3.13.0 \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 nvidia-ml-py==13.615.71 megatron-bridge==0.6.2 \
    megatron-energon==7.4.1 multi-storage-client==1.3.1 webdataset==1.0.2 braceexpand==0.1.7 bracex==3.2.4 \
    wcmatch==10.2.1 lark==1.3.1 xattr==1.3.1 cffi==2.1.1 pycparser==3.12 rapidyaml==0.15.2 deprecation==2.1.0 \
    filetype==1.2.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    opentelemetry-api==1.45.3 importlib-metadata==10.2.0
# antlr4 (hydra's parser runtime) is published as a source distribution only.
"$python" -m pip wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
