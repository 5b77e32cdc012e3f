#!/usr/bin/env bash
# The Megatron-Bridge tier's virtualenv: megatron-bridge 0.6.2 in its own site-packages, the
# rest (torch, megatron-core 0.19.2, the editable megatron-ext) from the main .venv through a
# .pth file, as tools/compat_venv.sh does for the megatron-core tiers.
#
#   bash tools/bridge_venv.sh               # -> .venv-bridge (fresh every time)
#
# Why not `pip install megatron-bridge==0.6.2`: on a CPU machine it cannot install. Its
# dependency fast-hadamard-transform is an sdist whose build needs CUDA, and
# nvidia-resiliency-ext 0.6.0 (imported at module level by bridge's pretrain) has only a
# manylinux_2_39 wheel, which pip on an older-glibc host refuses. So, all from the package
# registry, nothing from elsewhere:
#   - megatron-bridge itself with --no-deps;
#   - the pure-Python dependencies its training path imports that the main venv lacks
#     (BRIDGE_DEPS below: found by importing megatron.bridge.training.pretrain);
#   - the nvidia-resiliency-ext wheel, downloaded for its platform and unpacked into the site
#     directory (its C extensions are not loaded on the paths megatron-ext uses).
# Transformer Engine, which megatron.bridge.peft.lora_layers imports unguarded, is not
# installed: megatron_ext.bridge.te_standin shows that one module an import stand-in
# (registry entry bridge-te-import, docs/bridge.md).
#
# Env: MAIN_VENV (.venv, made by tools/setup.sh), TIER_VENV (.venv-bridge).
set -euo pipefail
cd "$(dirname "$0")/.."

BRIDGE_VERSION=0.6.2
NVRX_VERSION=0.6.0
# The nvidia-resiliency-ext tier (tests/nvrx) runs here too: nvrx's ft_launcher needs grpcio
# and httpcore besides what Bridge brings. The dependencies (besides the main venv's) that
# `import megatron.bridge.training.pretrain` reaches, found by importing it until it imported (energon, modelopt and their own); each
# with --no-deps, so nothing CUDA-only comes along (antlr4 pinned to the runtime hydra-core
# 1.3 generated its grammar with; pytest loads hydra as a plugin). Wheels where one exists.
BRIDGE_DEPS=(
    omegaconf hydra-core antlr4-python3-runtime==4.9.3 einops defusedxml httpx pyarrow pandas
    datasets multiprocess dill xxhash megatron-energon multi-storage-client xattr cffi
    pycparser lark wcmatch bracex jsonschema jsonschema-specifications attrs referencing rpds-py
    opentelemetry-api braceexpand rapidyaml deprecation filetype webdataset nvidia-modelopt
    requests urllib3 certifi pulp orloge cpsat-logutils scipy tensorboard protobuf absl-py
    grpcio httpcore
)
MAIN_VENV=${MAIN_VENV:-.venv}
TIER_VENV=${TIER_VENV:-.venv-bridge}
# shellcheck source=tools/tier_venv.sh
source tools/tier_venv.sh
tier_venv_create
# One pip call: megatron-bridge and megatron-energon both install into the megatron/
# namespace directory, and a second `pip install --target` skips a directory that exists.
"$MAIN_VENV/bin/pip" install -q --no-deps --prefer-binary --target "$TIER_SITE" \
    "megatron-bridge==$BRIDGE_VERSION" "${BRIDGE_DEPS[@]}"
tier_unpack_nvrx "$NVRX_VERSION"
tier_venv_finish
"$TIER_VENV/bin/python" - "$BRIDGE_VERSION" <<'EOF'
import importlib.metadata, sys
import megatron.core, megatron_ext, torch
from megatron_ext.bridge import te_standin
te_standin.install()
import megatron.bridge.training.pretrain  # noqa: F401  the whole training path imports
import nvidia_resiliency_ext.fault_tolerance.launcher  # noqa: F401  ft_launcher (tests/nvrx)
found = importlib.metadata.version("megatron-bridge")
assert found == sys.argv[1], f"tier venv imports megatron-bridge {found}, not {sys.argv[1]}"
core = importlib.metadata.version("megatron-core")
print(f"bridge tier ready: megatron-bridge {found}, megatron-core {core}, torch {torch.__version__}")
EOF
