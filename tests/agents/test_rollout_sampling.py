"""Sampling: filtering maths, exactness of the exponential race, reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from veriloop.agents.sampling_params import SamplingParams, filtered_logprobs, sample_next


def test_top_k_and_top_p_keep_the_documented_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = filtered_logprobs(logits, SamplingParams(top_k=2)).exp()
    torch.testing.assert_close(top_k, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p=0.8: mass before token 2 is 0.8 >= 0.8, so only the first two stay
    top_p = filtered_logprobs(logits, SamplingParams(top_p=0.8)).exp()
    torch.testing.assert_close(top_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top_p = filtered_logprobs(logits, SamplingParams(top_p=0.81)).exp()
    torch.testing.assert_close(top_p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    hot = filtered_logprobs(logits, SamplingParams(temperature=2.0)).exp()
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))


def test_sampler_draws_from_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    tokens, lps = sample_next(logits, SamplingParams(), gen)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.01)  # 4 sigma ~ 0.01 at n = 40k
    torch.testing.assert_close(lps, probs.log()[tokens])
    tokens, _ = sample_next(logits, SamplingParams(top_k=1), gen)
    assert (tokens == 0).all()
    # filtered-out tokens (q = 0) never come up, wherever they sit in the vocabulary
    holes = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0]).log().expand(20_000, 5)
    tokens, lps = sample_next(holes, SamplingParams(), gen)
    assert set(tokens.tolist()) == {1, 3} and torch.isfinite(lps).all()


def test_greedy_records_model_logprobs_and_seeds_reproduce():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    tokens, lps = sample_next(logits, SamplingParams.greedy(), None)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).max(-1).values)

    def draw(seed):
        return sample_next(
            logits.expand(64, 3, 50).reshape(-1, 50), SamplingParams(), torch.Generator().manual_seed(seed)
        )[0]

    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))


def test_invalid_settings_say_what_to_do():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(TypeError, match=r"stop=\('x',\)"):
        SamplingParams(stop="x")  # type: ignore[arg-type]
    assert SamplingParams.greedy().is_greedy and SamplingParams().is_untruncated
    assert not math.isnan(filtered_logprobs(torch.zeros(1, 3), SamplingParams(top_p=0.5)).exp().sum().item())
