#!/usr/bin/env bash
# megatron-ext set-up: system tools the tests use, then a fresh Python 3.12 virtualenv with the
# package installed in editable mode with its test extras.
#
#   bash tools/setup.sh            # from the repository root
#
# Env: PYTHON (default: python3.12, via pyenv's 3.12.1 when pyenv is present), VENV (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# Slurm + munge: the real-Slurm tests; iproute2, util-linux (unshare, nsenter): the two-node
# cluster of network namespaces; procps: pgrep, which the launchers' rank wrapper uses.
SYSTEM_PACKAGES=(shellcheck slurmctld slurmd slurm-client munge iproute2 util-linux procps)

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    for package in "${SYSTEM_PACKAGES[@]}"; do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
else
    echo "setup: not root or no apt-get; install ${SYSTEM_PACKAGES[*]} yourself for the launch tests" >&2
fi

if [ -z "${PYTHON:-}" ]; then
    if command -v pyenv >/dev/null && pyenv versions --bare | grep -qx '3.12.1'; then
        export PYENV_VERSION=3.12.1
    fi
    PYTHON=python3.12
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e '.[test]'
"$VENV/bin/python" -c "import megatron.core, megatron_ext; print('megatron-ext ready:', megatron.core.__file__)"
