#!/usr/bin/env bash
# A compatibility-tier virtualenv: megatron-core==VERSION alone in its own site-packages, and
# everything else (torch, the other dependencies, the editable megatron-ext) from the main
# .venv through a .pth file. About 30 MB and ~20 s instead of a 5.8 GB, ~3 min full venv; the
# tier's megatron-core comes first on sys.path, so it is the one imported and the one
# importlib.metadata reports.
#
#   bash tools/compat_venv.sh 0.18.2            # -> .venv-mc-0.18.2 (fresh every time)
#
# Env: MAIN_VENV (.venv, made by tools/setup.sh), TIER_VENV (.venv-mc-VERSION).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: tools/compat_venv.sh MEGATRON_CORE_VERSION}
MAIN_VENV=${MAIN_VENV:-.venv}
TIER_VENV=${TIER_VENV:-.venv-mc-$VERSION}
MAIN_SITE=$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
BASE_PYTHON=$("$MAIN_VENV/bin/python" -c 'import sys; print(sys._base_executable)')

rm -rf "$TIER_VENV"
"$BASE_PYTHON" -m venv --without-pip "$TIER_VENV"
TIER_SITE=$("$TIER_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# The main venv's pip installs into the tier's own site-packages, megatron-core only.
"$MAIN_VENV/bin/pip" install -q --no-deps --target "$TIER_SITE" "megatron-core==$VERSION"
# site.addsitedir (not a bare path line) also runs the main venv's own .pth files, so the
# editable megatron-ext install resolves as it does there.
echo "import site; site.addsitedir('$(cd "$MAIN_SITE" && pwd)')" > "$TIER_SITE/zz_main_venv.pth"
"$TIER_VENV/bin/python" - "$VERSION" <<'EOF'
import importlib.metadata, sys
import megatron.core, megatron_ext, torch
found = importlib.metadata.version("megatron-core")
assert found == sys.argv[1], f"tier venv imports megatron-core {found}, not {sys.argv[1]}"
print(f"compat tier ready: megatron-core {found} ({megatron.core.__file__}), torch {torch.__version__}")
EOF
