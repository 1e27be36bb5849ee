#!/usr/bin/env bash
# Liger-Kernel's two Hopper kernels on the GPU device machine (bench --methods liger_sm90,liger_tp_native), which
# has no network and takes at most 64 MiB of carried files per call. What this did on the H200 is in
# docs/benchmarks.md ("Liger's Hopper kernels").
#
# Here (with network):   scripts/device_liger.sh pack
#   fills build/liger1 (~42 MB) and build/liger2 (~56 MB), both git-ignored. Also run scripts/device_wheels.sh.
# On the device, two calls in a row to a machine kept warm (it goes back after 30 s idle):
#   call 1, carry [".whl", "build/liger1"]:  bash scripts/device_liger.sh install 1
#   call 2, carry ["build/liger2"]:          bash scripts/device_liger.sh install 2 && source /tmp/liger_env.sh && ...
# /tmp/liger_env.sh sets PYTHONPATH (/tmp/site, the CuTe DSL's packages, the ray stand-in, the checkout) and
# NVSHMEM's settings: one GPU, no remote transport, and NVLink multicast off (the machine's rule).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"

pack() {
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" \
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
        nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 nvidia-cuda-runtime-cu12==12.9.79 \
        nvidia-nvshmem-cu12==3.6.5 liger-cute-kernels==0.8.5
    rm -rf build/liger1 build/liger2
    mkdir -p build/liger1 build/liger2 "$work/cu13" "$work/lck" "$work/nv" "$work/rt"
    cp "$work"/nvidia_cutlass_dsl-4.8.1-*.whl "$work"/nvidia_cutlass_dsl_libs_base-*.whl \
        "$work"/nvidia_cutlass_dsl_libs_core-*.whl "$work"/apache_tvm_ffi-*.whl build/liger1/
    # the CuTe DSL's CUDA 13 libraries (92 MB as a wheel, 64 MB as xz): two parts, one per call
    (cd "$work/cu13" && unzip -q "$work"/nvidia_cutlass_dsl_libs_cu13-*.whl)
    tar cf - -C "$work/cu13" . | xz -9 -T0 > "$work/cu13.tar.xz"
    split -b 30000000 "$work/cu13.tar.xz" "$work/cu13.part."
    cp "$work/cu13.part.aa" build/liger1/
    cp "$work"/cu13.part.a[b-z] build/liger2/
    # liger-cute-kernels without its Blackwell library and its MoE module (6 MB as xz)
    (cd "$work/lck" && unzip -q "$work"/liger_cute_kernels-*.whl -x '*.cubin' '*sm100f.so')
    tar cf - -C "$work/lck" . | xz -9 -T0 > build/liger1/liger_cute_kernels_sm90.tar.xz
    # the CUDA 12 runtime and NVSHMEM host libraries that CUDA 12 build loads
    (cd "$work/rt" && unzip -q "$work"/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12')
    cp "$work/rt/nvidia/cuda_runtime/lib/libcudart.so.12" build/liger1/
    (cd "$work/nv" && unzip -q "$work"/nvidia_nvshmem_cu12-*.whl \
        'nvidia/nvshmem/lib/libnvshmem_host.so.3' 'nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3')
    tar cf - -C "$work/nv/nvidia/nvshmem/lib" . | xz -9 -T0 > build/liger2/nvshmem_cu12_host.tar.xz
    du -sh build/liger1 build/liger2
}

install() {
    case "$1" in
    1)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl build/liger1/*.whl
        cp build/liger1/cu13.part.aa /tmp/
        tar xJf build/liger1/liger_cute_kernels_sm90.tar.xz -C /tmp/site
        mkdir -p /tmp/cudart12 && cp build/liger1/libcudart.so.12 /tmp/cudart12/
        ;;
    2)
        cat /tmp/cu13.part.aa build/liger2/cu13.part.a[b-z] | xz -d | tar x -C /tmp/site
        # Liger loads NVSHMEM from its own folder first
        tar xJf build/liger2/nvshmem_cu12_host.tar.xz -C /tmp/site/liger_cute_kernels
        cat > /tmp/liger_env.sh <<ENV
export LD_LIBRARY_PATH=/tmp/cudart12:\${LD_LIBRARY_PATH:-}
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/scripts/device_stubs:$PWD
ENV
        ;;
    *) echo "install: expected 1 or 2, got '$1'" >&2; exit 2 ;;
    esac
}

case "${1:-}" in
pack) pack ;;
install) install "${2:-}" ;;
*) echo "usage: $0 pack | install 1|2" >&2; exit 2 ;;
esac
