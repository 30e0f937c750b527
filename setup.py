"""Which packages a wheel holds: every directory under neuronbuild/ (found, never listed by hand; data-only ones such
as packaging/templates too) plus the Starlark macro library rules/ installed as neuronbuild.rules. Everything else is
in pyproject.toml."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["neuronbuild", "neuronbuild.*"], exclude=["*.__pycache__"]),
              "neuronbuild.rules"],
    package_dir={"neuronbuild.rules": "rules"},
)
