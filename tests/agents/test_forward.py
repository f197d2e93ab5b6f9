"""token_logprobs with first_position computes only the needed logits, and agrees with the full pass."""

from __future__ import annotations

import pytest
import torch

from veriloop.agents.forward import first_loss_position, token_logprobs
from veriloop.agents.testing import tiny_policy


@pytest.fixture(scope="module")
def model():
    return tiny_policy().model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("first", [1, 2, 5, 11])
def test_first_position_matches_full_pass(first, lora):
    model = tiny_policy(lora=lora).model
    ids = torch.randint(0, model.config.vocab_size, (3, 12))
    attn = torch.ones_like(ids)
    full, full_ent = token_logprobs(model, ids, attn, with_entropy=True)
    part, part_ent = token_logprobs(model, ids, attn, with_entropy=True, first_position=first)
    assert part.shape == full.shape == (3, 12)
    torch.testing.assert_close(part[:, first:], full[:, first:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part_ent[:, first:], full_ent[:, first:], rtol=1e-5, atol=1e-5)
    assert (part[:, :first] == 0).all()


def test_first_position_asks_model_for_fewer_logits(model):
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("logits_to_keep"))
        return model(*args, **kwargs)

    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    token_logprobs(spy, ids, torch.ones_like(ids), first_position=6)
    assert seen == [5]  # positions 5..9: position 5 predicts token 6


def test_first_loss_position():
    m = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 0]])
    assert first_loss_position(m) == 2
    assert first_loss_position(torch.zeros(2, 4)) == 1
