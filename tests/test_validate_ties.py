"""`validate --generate`'s comparison of greedy tokens with transformers' (toolchains/validate.py
`_against_transformers`), on a real tiny transformers Llama in bf16: a token where transformers' own logits tie is
reported as a tie and the check goes on from it; a token far below transformers' top one fails, naming the gap.

The compiled graphs' tokens are planted here (the comparison's input); transformers is the real model, as validate
runs it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from neuronbuild.toolchains.validate import _against_transformers

NEW = 6


def _ref(zero_head: bool, serving: bool = False) -> Any:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if zero_head:  # every logit 0 at every step: every token ties with transformers' choice (the first, id 0)
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return SimpleNamespace(model=model, serving=serving, cache=lambda: None)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0 four tokens, row 1 two (left-padded with 0)."""
    return torch.tensor([[3, 9, 12, 7], [0, 0, 5, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])


@pytest.mark.parametrize("serving", [False, True], ids=["static_batch", "each_request_alone"])
def test_a_planted_tie_is_reported_as_a_tie_and_the_check_goes_on_from_the_graphs_token(serving: bool) -> None:
    ref = _ref(zero_head=True, serving=serving)
    ids, mask = _prompts()
    with torch.no_grad():
        want = ref.model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[:, -NEW:]
    assert want.tolist() == [[0] * NEW] * 2  # all logits tied: transformers takes the first
    got = want.clone()
    got[1, 2] = 17  # the graphs chose another of the tied tokens there
    with torch.no_grad():
        ok, detail = _against_transformers(ref, ids, mask, got, tolerance=1e-4)
    assert ok, detail
    assert "but for 1 tie" in detail and "row 1 new token 3: 17, transformers 0" in detail, detail
    assert "top-2 gap there 0" in detail, detail


def test_a_token_beyond_rounding_fails_naming_the_gap() -> None:
    ref = _ref(zero_head=False)
    ids, mask = _prompts()
    with torch.no_grad():
        want = ref.model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[:, -NEW:]
        logits = ref.model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
                                    eos_token_id=None, output_logits=True, return_dict_in_generate=True).logits[0]
    got = want.clone()
    worst = int(logits[0].float().argmin())  # transformers' least likely first token for row 0
    got[0, 0] = worst
    with torch.no_grad():
        ok, detail = _against_transformers(ref, ids, mask, got, tolerance=1e-4)
    assert not ok
    assert f"row 0 new token 1: {worst}, transformers {int(want[0, 0])}" in detail, detail
    assert "differs beyond rounding" in detail, detail
    with torch.no_grad():  # and the same tokens as transformers' are equal, no tie
        assert _against_transformers(ref, ids, mask, want, tolerance=1e-4) == (True, f"{NEW} tokens x 2 equal")
