"""Multi-turn rollouts with a tiny VLM: every turn's model input carries every image so far."""

from __future__ import annotations

import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.engine import RolloutLimits, grouped_specs, rollout
from veriloop.agents.forward import token_logprobs
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.scripted import ScriptedPolicy


@pytest.fixture(scope="module")
def vlm():
    from veriloop.agents.testing import tiny_policy

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_policy(vision=True)
    torch.set_num_threads(n)


def test_images_reach_the_model_on_every_turn(vlm):
    from veriloop.agents.testing import IMAGE_TOKEN

    image_id = vlm.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    seen = []  # per forward call: (images passed, image tokens per row) when pixel_values are passed
    forward = vlm.model.forward

    def spy(*args, **kwargs):
        if kwargs.get("pixel_values") is not None:
            seen.append((kwargs["pixel_values"].shape[0], (kwargs["input_ids"] == image_id).sum(-1).tolist()))
        return forward(*args, **kwargs)

    vlm.model.forward = spy
    try:
        specs = grouped_specs("veriloop/Points24-vision-v0", {"max_attempts": 3}, [0], 2)
        trajs = rollout(
            vlm, specs, sampling=SamplingParams(max_new_tokens=6, seed=2), limits=RolloutLimits(max_turns=3)
        )
    finally:
        del vlm.model.forward
    per_image = 16  # 32x32 image, patch 8
    assert seen == [(2 * k, [k * per_image] * 2) for k in (1, 2, 3)]  # 2 episodes, k images each on turn k
    for tr in trajs:
        assert tr.num_turns == 3 and tr.extras["pixel_values"].shape[0] == 3
        assert sum(i == image_id for i in tr.token_ids) == 3 * per_image
        assert all(m == 0 for i, m in zip(tr.token_ids, tr.loss_mask) if i == image_id)
        assert [p["type"] for p in tr.messages[0]["content"]] == ["image", "text"]  # JSON-ready placeholders


def test_vision_logprobs_match_a_fresh_forward_pass(vlm):
    specs = grouped_specs("veriloop/Points24-vision-v0", {"max_attempts": 2}, [1, 2], 1)
    trajs = rollout(vlm, specs, sampling=SamplingParams(max_new_tokens=6, seed=4))
    for tr in trajs:
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            fresh, _ = token_logprobs(vlm.model, ids, torch.ones_like(ids), **tr.extras)
        mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(fresh[0][mask], torch.tensor(tr.logprobs)[mask], atol=2e-4, rtol=1e-4)


def test_text_policy_on_a_vision_env_fails_loudly(vlm):
    script = ScriptedPolicy({0: "x"}, vlm.tokenizer)
    with pytest.raises(ValueError, match="load a VLM"):
        rollout(script, grouped_specs("veriloop/Points24-vision-v0", {}, [0], 1), sampling=SamplingParams())
