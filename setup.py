"""The dependencies (pyproject.toml holds the rest): the megatron-core range is read from
megatron_ext/common/versions.py, its one declaration, as a file, so that building never
imports the package or Megatron."""

import runpy
from pathlib import Path

from setuptools import setup

VERSIONS = runpy.run_path(str(Path(__file__).parent / "megatron_ext" / "common" / "versions.py"))

setup(
    install_requires=[
        VERSIONS["REQUIREMENT"],
        "torch>=2.6",
        "numpy",
        "filelock>=3.12",
        "packaging>=24",
        "pyarrow>=16",  # the signals log
        "PyYAML>=6",  # a Megatron-Bridge run's run_config.yaml (lookup, skiplist)
        "tokenizers>=0.19",  # offline BPE training for `megatron-ext preprocess`
        "tqdm",  # progress of preprocess and the lookup's scans
        "matplotlib",  # `megatron-ext plot` (Agg backend, no display needed)
        # Not imported here; undeclared by megatron-core, which needs them on the training path:
        "psutil",  # its checkpoint code
        "transformers>=4.57",  # its HuggingFaceTokenizer
    ],
)
