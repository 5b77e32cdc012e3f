"""megatron-ext: a thin overlay on NVIDIA Megatron Core for stable, debuggable pretraining."""

import runpy
from pathlib import Path

from setuptools import Extension, find_packages, setup

# The supported range is declared once, in megatron_ext/common/versions.py (standard library only):
# read as a file, so that building never imports the package or Megatron.
VERSIONS_FILE = Path(__file__).parent / "megatron_ext" / "common" / "versions.py"
VERSIONS = runpy.run_path(str(VERSIONS_FILE))

setup(
    name="megatron-ext",
    version="0.1.0",
    description=(
        "Megatron Core overlay: z-loss, weight-decay overrides, per-bucket grad norms, "
        "spike tracking with automatic rollback/skip, and sample-id reverse lookup."
    ),
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    # Megatron's training flags as data, generated from its parser (the lookup's fast path).
    package_data={"megatron_ext.lookup": ["megatron_flags/*.json"]},
    py_modules=["pretrain_gpt_ext"],
    # The signals log's C scanner (`megatron-ext plot` at millions of iterations). Optional:
    # without a C compiler the install goes on, and the numpy path gives the same values.
    ext_modules=[
        Extension(
            "megatron_ext.common.records._scan",
            ["megatron_ext/common/records/_scan.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        )
    ],
    install_requires=[
        VERSIONS["REQUIREMENT"],
        "torch>=2.6",
        "matplotlib",  # `megatron-ext plot` (Agg backend, no display needed)
        "numpy",
        "psutil",  # imported by Megatron's checkpoint code, not declared by megatron-core
        "tokenizers>=0.19",  # offline BPE training for `megatron-ext preprocess`
        "tqdm",
        "transformers>=4.57",  # Megatron loads the HuggingFaceTokenizer through it
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "ruff==0.17.6"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
