"""Packages `kernels_cu/` and `conf/` into the wheel as `paged._kernels_cu` and `paged._conf`.

They stay top-level in the repository (the layout researchers edit); paged/utils/assets.py finds them
in either place. Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

TREES = {"paged._kernels_cu": "kernels_cu", "paged._conf": "conf"}

setup(
    packages=find_packages(include=["paged*"]) + list(TREES),
    package_dir=TREES,
    package_data={
        "paged.data": ["*.txt", "traces/*.csv", "traces/*.md", "tokenizers/*/*"],
        "paged._kernels_cu": ["*.cu", "*.cuh", "emu/*", "cpu/*"],
        "paged._conf": ["*.yaml", "*/*.yaml", "*/*/*.yaml"],
    },
)
