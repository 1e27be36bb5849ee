#!/usr/bin/env bash
# Transformer Engine 2.20.2 on the GPU device machine (an H200: no network, at most 64 MiB carried per call), so that
# mbridge's Transformer Engine layer spec and TE's packed-sequence attention run there. Timings and what was seen:
# docs/benchmarks.md ("Transformer Engine (H200; H100 rows)"); the runs made with it: scripts/device_te_runs.sh.
#
# Here (with network):  scripts/device_te.sh pack
#   fills build/te (git-ignored, ~40 MB): the core wheel's files with libtransformer_engine.so cut to its sm_90
#   cubins (scripts/te_keep_sm90.py: 343 MB -> ~23 MB as xz), the transformer_engine_torch source, and the wheels
#   TE imports that the device lacks. Also run scripts/device_wheels.sh (megatron-core, verl, mbridge: .whl).
# On the device, carry [".whl", "build/te"]:
#   bash scripts/device_te.sh install                       # ~10 s: core and wheels into /tmp/site
#   setsid bash scripts/device_te.sh build >/tmp/te_build.log 2>&1 < /dev/null &   # compiles in the background
#   ... other work in the same call or the next (the machine stays warm 30 s after a call) ...
#   bash scripts/device_te.sh wait && source /tmp/te_env.sh  # blocks until the extension is built, then checks it
#   bash scripts/device_te.sh keep "$OUT"                    # bring the built extension back, into build/te here
# The build (33 C++ files against the device's own torch, 1 min 41 s on its 16 cores) is needed once per torch
# version: `install` takes build/te/transformer_engine_torch-VERSION-torchVERSION.so.xz when it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
TE_VERSION=2.20.2

pack() {
    local python="${PYTHON:-.venv/bin/python}" work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$work/wheels" \
        "transformer_engine_cu13==$TE_VERSION" nvidia-cudnn-frontend==1.32.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 nvdlfw-inspect==0.2.2 \
        "transformer-engine==$TE_VERSION"
    # transformer_engine_torch is published as source only; pip would build it here to read its metadata
    "$python" - "$work" "$TE_VERSION" <<'PY'
import json, sys, urllib.request
work, version = sys.argv[1], sys.argv[2]
request = urllib.request.Request("https://pypi.org/simple/transformer-engine-torch/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request))["files"]
sdist = next(f for f in files if f["filename"] == f"transformer_engine_torch-{version}.tar.gz")
urllib.request.urlretrieve(sdist["url"], f"{work}/{sdist['filename']}")
PY
    rm -rf build/te/wheels build/te/te_core.tar.xz build/te/transformer_engine_torch-*.tar.gz  # a prebuilt .so stays
    mkdir -p build/te/wheels "$work/core"
    (cd "$work/core" && unzip -q "$work"/wheels/transformer_engine_cu13-*.whl)
    local lib="$work/core/transformer_engine/wheel_lib/libtransformer_engine.so"
    "$python" scripts/te_keep_sm90.py "$lib" "$lib.sm90"
    mv "$lib.sm90" "$lib"
    tar cf - -C "$work/core" . | xz -9 -T0 > build/te/te_core.tar.xz
    rm "$work"/wheels/transformer_engine_cu13-*.whl
    cp "$work"/wheels/*.whl build/te/wheels/
    cp "$work"/transformer_engine_torch-*.tar.gz build/te/
    du -sh build/te
}

install() {
    mkdir -p /tmp/site
    # the wheels first: pip --target --upgrade replaces a top-level folder it installs, and the meta package
    # (whose dist-info TE's import checks for) ships a transformer_engine/ of its own; the core's files go last
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        build/te/wheels/*.whl
    tar xJf build/te/te_core.tar.xz -C /tmp/site
    local prebuilt
    prebuilt="build/te/$(prebuilt_name)"
    if [ -f "$prebuilt" ]; then  # built on a device with this torch before (`keep`): no rebuild
        xz -dc "$prebuilt" > /tmp/site/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so
        echo "prebuilt $prebuilt" > /tmp/te_build.done
    fi
    cat > /tmp/te_env.sh <<ENV
export PYTHONPATH=/tmp/site:$PWD/scripts/device_stubs:$PWD\${PYTHONPATH:+:\$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENV
}

prebuilt_name() {  # no '+' (torch's local version): a device call hands back only names of [A-Za-z0-9._-]
    echo "transformer_engine_torch-$TE_VERSION-torch$(python3 -c 'import torch; print(torch.__version__)' | tr '+' '_').so.xz"
}

keep() {  # the built extension, xz-compressed (~1.1 MB), into folder $1 (the device call's $OUT) for build/te
    xz -6 -T0 -c /tmp/site/transformer_engine_torch*.so > "$1/$(prebuilt_name)"
}

build() {
    local start source
    start=$(date +%s)
    rm -rf /tmp/te_build /tmp/te_build.done && mkdir -p /tmp/te_build
    tar xzf build/te/transformer_engine_torch-*.tar.gz -C /tmp/te_build
    source=$(echo /tmp/te_build/transformer_engine_torch-*)
    # the prebuilt-wheel download is skipped (no network); NCCL EP stays out of the extension (no-op sources)
    (cd "$source" && PYTHONPATH=/tmp/site CUDA_HOME=/usr/local/cuda NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 \
        MAX_JOBS="$(nproc)" python3 setup.py build_ext --inplace)
    cp "$source"/transformer_engine_torch*.so /tmp/site/
    echo "built in $(( $(date +%s) - start )) s" > /tmp/te_build.done
}

wait_built() {
    local waited=0
    until [ -f /tmp/te_build.done ]; do
        if ! pgrep -f "device_te.sh build" >/dev/null; then
            echo "the TE build is not running and left no result; its log:" >&2
            tail -n 40 /tmp/te_build.log >&2 || true
            exit 1
        fi
        sleep 5
        waited=$((waited + 5))
    done
    cat /tmp/te_build.done
    # shellcheck disable=SC1091
    source /tmp/te_env.sh
    python3 -c "import transformer_engine.pytorch as te, transformer_engine_torch as tex; import transformer_engine; print('transformer_engine', transformer_engine.__version__, 'cuDNN', tex.get_cudnn_version())"
}

case "${1:-}" in
pack) pack ;;
install) install ;;
build) build ;;
wait) wait_built ;;
keep) keep "${2:?keep needs a folder}" ;;
*) echo "usage: $0 pack | install | build | wait | keep DIR" >&2; exit 2 ;;
esac
