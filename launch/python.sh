# Sourced by the launchers (run_single_node.sh, pretrain_gpt_ext.sbatch) with $root set: the
# interpreter that runs `megatron-ext supervise`, in $python. MEGATRON_EXT_PYTHON when set,
# else the checkout's .venv (what tools/setup.sh makes), else $PYTHON, else python from PATH.
# megatron-ext needs Python >= 3.12: any other interpreter is refused in one line that says
# what to set, instead of a SyntaxError traceback from the package's first import.
# shellcheck shell=bash disable=SC2154  # $root: set by the launcher that sources this

if [[ -n ${MEGATRON_EXT_PYTHON:-} ]]; then
    python=$MEGATRON_EXT_PYTHON
elif [[ -x $root/.venv/bin/python ]]; then
    python=$root/.venv/bin/python
else
    python=${PYTHON:-python}
fi
if ! version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    version="not runnable"
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    echo "$(basename "$0"): megatron-ext needs Python >= 3.12 and $python is $version: set" \
        "MEGATRON_EXT_PYTHON to its virtualenv's python (bash tools/setup.sh makes $root/.venv)" >&2
    exit 2
fi
