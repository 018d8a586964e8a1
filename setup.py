"""One import root: the folders at the repository's top install as parts of `kvscope`.

engine/ becomes kvscope.engine, kernels/ kvscope.kernels, ui/ kvscope.ui and storage/
kvscope.storage, so kvscope takes no generic top-level name (`engine`, `ui`, or Hugging
Face's `kernels`) in the environment it is installed into. Everything else about the
project is in pyproject.toml.
"""

from setuptools import find_packages, setup

PARTS = ("engine", "kernels", "ui", "storage")

setup(
    packages=["kvscope", *(f"kvscope.{package}" for package in
                           find_packages(include=[f"{part}*" for part in PARTS]))],
    package_dir={"kvscope": "kvscope", **{f"kvscope.{part}": part for part in PARTS}},
)
