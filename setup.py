"""Which packages a wheel holds: every package under neuronbuild/ (found, never listed by hand) plus the Starlark
macro library rules/ installed as neuronbuild.rules. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["neuronbuild", "neuronbuild.*"]), "neuronbuild.rules"],
    package_dir={"neuronbuild.rules": "rules"},
)
