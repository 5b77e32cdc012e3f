# shellcheck shell=bash
# Sourced by tools/bridge_venv.sh and tools/nvrx_venv.sh: a tier virtualenv whose own
# site-packages holds what the tier adds, the rest (torch, megatron-core, the editable
# megatron-ext) from the main .venv through a .pth file, as tools/compat_venv.sh does.
# Env: MAIN_VENV (.venv, made by tools/setup.sh), TIER_VENV (the tier's venv).

# A fresh TIER_VENV without pip; sets TIER_SITE (its site-packages) and MAIN_SITE.
tier_venv_create() {
    MAIN_SITE=$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    local base
    base=$("$MAIN_VENV/bin/python" -c 'import sys; print(sys._base_executable)')
    rm -rf "$TIER_VENV"
    "$base" -m venv --without-pip "$TIER_VENV"
    TIER_SITE=$("$TIER_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
}

# nvidia-resiliency-ext VERSION unpacked into TIER_SITE: it has only a manylinux_2_39 wheel,
# which pip on an older-glibc host refuses (its C extensions are not loaded on the paths
# megatron-ext uses).
tier_unpack_nvrx() {
    local wheels
    wheels=$(mktemp -d)
    "$MAIN_VENV/bin/pip" download -q --no-deps --only-binary=:all: \
        --platform manylinux_2_39_x86_64 --python-version 3.12 \
        -d "$wheels" "nvidia-resiliency-ext==$1"
    "$MAIN_VENV/bin/python" -m zipfile -e "$wheels"/nvidia_resiliency_ext-*.whl "$TIER_SITE"
    rm -rf "$wheels"
}

# Bytecode now (every tier launch imports the tier's packages in every rank), and the .pth to
# the main venv: site.addsitedir, not a bare path line, so the main venv's own .pth files run
# too and the editable megatron-ext install resolves as it does there.
tier_venv_finish() {
    "$MAIN_VENV/bin/python" -m compileall -q -j 0 "$TIER_SITE" >/dev/null || true
    echo "import site; site.addsitedir('$(cd "$MAIN_SITE" && pwd)')" >"$TIER_SITE/zz_main_venv.pth"
}
