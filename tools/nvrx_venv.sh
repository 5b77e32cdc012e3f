#!/usr/bin/env bash
# The nvidia-resiliency-ext tier's virtualenv (tests/nvrx): nvrx 0.6.0 unpacked from its wheel,
# with the few pure-Python packages its ft_launcher imports, the rest (torch, megatron-core
# 0.19.2, the editable megatron-ext) from the main .venv through a .pth file, as
# tools/compat_venv.sh does. Its own venv, not .venv-bridge: there every rank of these
# Megatron launches also imported nvidia-modelopt (megatron.training.checkpointing imports it
# where installed, a Bridge dependency), several CPU seconds per rank for nothing nvrx uses.
#
#   bash tools/nvrx_venv.sh                 # -> .venv-nvrx (fresh every time)
#
# nvrx is unpacked, not pip-installed (tools/tier_venv.sh says why).
# Env: MAIN_VENV (.venv, made by tools/setup.sh), TIER_VENV (.venv-nvrx).
set -euo pipefail
cd "$(dirname "$0")/.."

NVRX_VERSION=0.6.0
# What `import nvidia_resiliency_ext.fault_tolerance.launcher` needs beyond the main venv.
NVRX_DEPS=(grpcio protobuf httpx httpcore defusedxml)
MAIN_VENV=${MAIN_VENV:-.venv}
TIER_VENV=${TIER_VENV:-.venv-nvrx}
# shellcheck source=tools/tier_venv.sh
source tools/tier_venv.sh
tier_venv_create
"$MAIN_VENV/bin/pip" install -q --no-deps --prefer-binary --target "$TIER_SITE" "${NVRX_DEPS[@]}"
tier_unpack_nvrx "$NVRX_VERSION"
tier_venv_finish
"$TIER_VENV/bin/python" - "$NVRX_VERSION" <<'EOF'
import importlib.metadata, importlib.util, sys
import megatron.core, megatron_ext, torch
import nvidia_resiliency_ext.fault_tolerance.launcher  # noqa: F401  ft_launcher (tests/nvrx)
found = importlib.metadata.version("nvidia-resiliency-ext")
assert found == sys.argv[1], f"tier venv imports nvidia-resiliency-ext {found}, not {sys.argv[1]}"
assert importlib.util.find_spec("modelopt") is None, "nvidia-modelopt leaked into the nvrx tier"
core = importlib.metadata.version("megatron-core")
print(f"nvrx tier ready: nvidia-resiliency-ext {found}, megatron-core {core}, torch {torch.__version__}")
EOF
