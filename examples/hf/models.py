"""transformers models as they come: each factory reads its config.json (declared as data) and builds the HF class."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

HERE = Path(__file__).parent


def _config(name: str):  # type: ignore[no-untyped-def]
    return AutoConfig.from_pretrained(HERE / name)  # reads HERE/<name>/config.json


def llama(config: dict) -> object:  # type: ignore[type-arg]
    return AutoModelForCausalLM.from_config(_config("llama"))


def gpt2(config: dict) -> object:  # type: ignore[type-arg]
    return AutoModelForCausalLM.from_config(_config("gpt2"))


def bert(config: dict) -> object:  # type: ignore[type-arg]
    return AutoModel.from_config(_config("bert"))


def vit(config: dict) -> object:  # type: ignore[type-arg]
    return AutoModel.from_config(_config("vit"))
