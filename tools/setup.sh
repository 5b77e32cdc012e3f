#!/usr/bin/env bash
# megatron-ext set-up: system tools the tests use, then a fresh Python 3.12 virtualenv with the
# package installed in editable mode with its test extras.
#
#   bash tools/setup.sh            # from the repository root
#
# Env: PYTHON (default: pyenv's 3.12 when pyenv is present, else python3.12), VENV (.venv).
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
    # pyenv's shims answer `python3.12` with "command not found" unless 3.12 is selected, so take
    # the interpreter from pyenv's versions directory directly (no pipe into `grep -q`: under
    # pipefail its early exit SIGPIPEs the producer and the test fails at random).
    PYTHON=python3.12
    if command -v pyenv >/dev/null; then
        for candidate in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
            if [ -x "$candidate" ]; then PYTHON=$candidate; fi
        done
    fi
fi
if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "setup: $PYTHON is not a working Python 3.12; install one (pyenv install 3.12) or set PYTHON=/path/to/python3.12" >&2
    exit 1
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -e '.[test]'
"$VENV/bin/python" -c "import megatron.core, megatron_ext; print('megatron-ext ready:', megatron.core.__file__)"
