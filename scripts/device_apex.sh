#!/usr/bin/env bash
# apex's fused_weight_gradient_mlp_cuda alone, for megatron's gradient_accumulation_fusion on the H200 (issue 44:
# "with megatron's gradient_accumulation_fusion"). megatron-core's ColumnParallelLinear (the output layer on either
# layer spec) refuses the option without this extension; Transformer Engine's layers accumulate into main_grad
# themselves. Three sources and a header of apex, built against the device's torch (no stable ABI here: the .so
# matches one torch build), sm_90 only.
#
#   here, with network or the fetch tool's mirror:   bash scripts/device_apex.sh pack build/apex    # ~10 KB
#   device, first call:   bash scripts/device_apex.sh build build/apex     # then `keep "$OUT"` hands the .so back
#   device, each call:    bash scripts/device_apex.sh install /tmp/apex_site build/apex   # prebuilt .so if carried
#                         bash scripts/device_apex.sh smoke /tmp/apex_site  # both functions against fp64
set -euo pipefail

APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d   # apex master, 2026-07-08
ROOT=/tmp/apex_build
MODULE=fused_weight_gradient_mlp_cuda
SOURCES=(csrc/type_shim.h csrc/megatron/fused_weight_gradient_dense.cpp
    csrc/megatron/fused_weight_gradient_dense_cuda.cu csrc/megatron/fused_weight_gradient_dense_16bit_prec_cuda.cu)

pack() {
    local dir="${1:?pack needs a folder}" apex work
    mkdir -p "$dir"; dir="$(cd "$dir" && pwd)"
    work="$(mktemp -d)"; trap 'rm -rf "$work"' RETURN
    apex="${APEX_GIT:-/work/.mirror/NVIDIA+apex/repo}"
    if [ ! -d "$apex" ]; then git clone -q --bare --filter=blob:none https://github.com/NVIDIA/apex "$work/apex.git"; apex="$work/apex.git"; fi
    git -C "$apex" archive "$APEX_COMMIT" "${SOURCES[@]}" | tar x -C "$work"
    tar cf - -C "$work" csrc | xz -9e > "$dir/apex_src.tar.xz"
    ls -l "$dir/apex_src.tar.xz"
}

# The .so's name carries the torch it was built against: a later call uses it only with that torch.
so_name() { python3 -c "import torch; print('$MODULE-torch' + torch.__version__.replace('+', '_') + '.so.xz')"; }

build() {
    local dir="${1:?build needs the pack folder}" start
    dir="$(cd "$dir" && pwd)"; start=$(date +%s)
    rm -rf "$ROOT" && mkdir -p "$ROOT" && tar xJf "$dir/apex_src.tar.xz" -C "$ROOT"
    # apex's setup.py entry for this extension (its flags), without the rest of apex's setup.py
    cat > "$ROOT/setup.py" <<EOF
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

nvcc = ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "--expt-relaxed-constexpr",
        "--expt-extended-lambda", "--use_fast_math"]
setup(
    name="$MODULE",
    ext_modules=[CUDAExtension(
        name="$MODULE", include_dirs=[os.path.abspath("csrc")],
        sources=["csrc/megatron/fused_weight_gradient_dense.cpp", "csrc/megatron/fused_weight_gradient_dense_cuda.cu",
                 "csrc/megatron/fused_weight_gradient_dense_16bit_prec_cuda.cu"],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc})],
    cmdclass={"build_ext": BuildExtension},
)
EOF
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
    # ATen's CUDA headers include cusparse.h and cublas_v2.h: where the toolkit lacks them, torch's own nvidia
    # packages have them (nvidia/cu13/include beside torch)
    local headers
    headers=$(python3 -c 'import glob, os, nvidia; print(":".join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "include"))))' 2>/dev/null || true)
    [ -z "$headers" ] || export CPATH="$headers${CPATH:+:$CPATH}"
    export MAX_JOBS="${MAX_JOBS:-3}"
    (cd "$ROOT" && python3 setup.py build_ext --inplace) > "$ROOT/build.log" 2>&1 || { tail -n 40 "$ROOT/build.log"; return 1; }
    ls -l "$ROOT"/$MODULE*.so
    echo "apex $MODULE built in $(( $(date +%s) - start )) s"
}

keep() {  # FOLDER: the built .so, xz'd, named after the torch it needs
    local out="${1:?keep needs a folder}"
    xz -6 -c "$ROOT"/$MODULE*.so > "$out/$(so_name)"
    ls -l "$out/$(so_name)"
}

install() {  # TARGET PACK_FOLDER: the prebuilt .so for this torch from the pack folder, else a build first
    local target="${1:?install needs a target folder}" dir="${2:?install needs the pack folder}" name
    name="$(so_name)"
    mkdir -p "$target"
    if [ -f "$dir/$name" ]; then
        xz -dc "$dir/$name" > "$target/$MODULE.so"
    else
        echo "no $name in $dir: building"
        build "$dir"
        cp "$ROOT"/$MODULE*.so "$target/$MODULE.so"
    fi
    echo "export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}" > /tmp/apex_env.sh
}

smoke() {  # TARGET: main_grad += grad_output^T input, fp32 and bf16 accumulators, against fp64
    local target="${1:?smoke needs the install folder}"
    PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'EOF'
import torch
import fused_weight_gradient_mlp_cuda as fused

g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
dy = torch.randn(4096, 3000, device="cuda", generator=g).bfloat16()
want = dy.double().t() @ x.double()
for dtype, accumulate, tolerance in ((torch.float32, fused.wgrad_gemm_accum_fp32, 1e-5),
                                     (torch.bfloat16, fused.wgrad_gemm_accum_fp16, 1e-2)):
    start = torch.randn(3000, 1024, device="cuda", generator=g).to(dtype)
    main_grad = start.clone()
    accumulate(x, dy, main_grad)
    error = ((main_grad.double() - start.double() - want).norm() / want.norm()).item()
    print(f"{accumulate.__name__}: relative error {error:.2e} (tolerance {tolerance:.0e})")
    assert error <= tolerance, error
print("apex fused_weight_gradient_mlp_cuda: OK")
EOF
}

case "${1:-}" in
pack | build | keep | install | smoke) "$@" ;;
*)
    echo "usage: $0 pack DIR | build DIR | keep DIR | install TARGET DIR | smoke TARGET" >&2
    exit 2
    ;;
esac
