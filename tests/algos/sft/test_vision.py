"""Vision SFT: examples carry the observation's image, tokenised as the rollout engine encodes it;
the loss is on the reply only; training feeds each row's images with it, whatever the micro-batches."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from veriloop.agents.testing import IMAGE_TOKEN, tiny_policy
from veriloop.algos.learner.batch import collate_tokens, minibatches, with_row_extras
from veriloop.algos.sft.data import SFTDataError, SFTExample, build_examples, demonstration_examples
from veriloop.algos.sft.train import tokenise, train_sft

torch.set_num_threads(1)
ENV = "veriloop/Points24-vision-v0"
TOKENS_PER_IMAGE = 16  # the tiny VLM: 32x32 images, patch 8


@pytest.fixture(scope="module")
def vlm():
    return tiny_policy(vision=True, seed=0)


def _image_tokens(policy, ids) -> int:
    image_id = policy.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    return sum(t == image_id for t in ids)


def test_a_vision_example_is_the_rollout_prompt_plus_the_reply(vlm):
    from veriloop.agents.chat import ChatFormat, observation_message

    (ex,) = demonstration_examples(ENV, {}, [0], images=True)
    assert ex.image_messages == (0,) and len(ex.images) == 1 and ex.images[0].shape == (128, 336, 3)
    data = tokenise(vlm.tokenizer, [ex], 2048, vlm.processor)
    ids, mask, vision = data.ids[0], data.masks[0], data.vision[0]
    assert vision["pixel_values"].shape == (1, 3, 32, 32)
    assert _image_tokens(vlm, ids) == TOKENS_PER_IMAGE
    # the prompt is token for token what the engine feeds the policy for this observation
    env = gym.make(ENV)
    obs, _ = env.reset(seed=0)
    fmt = ChatFormat(vlm.tokenizer, None, processor=vlm.processor)
    message, image = observation_message(obs)
    prompt, inputs = fmt.encode_multimodal(fmt.prompt_text(fmt.first_messages(message)), [image])
    assert ids[: len(prompt)] == prompt
    torch.testing.assert_close(inputs["pixel_values"], vision["pixel_values"])
    # the loss covers exactly the reply (and the end-of-turn the template writes after it)
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    reply = ex.messages[-1]["content"]
    assert vlm.tokenizer.decode(ids[len(prompt) :]) == reply + "<|im_end|>\n"


def test_every_image_bearing_turn_gets_its_image_and_only_trainable_turns_train(vlm):
    rng = np.random.default_rng(0)
    red, noise = np.zeros((20, 30, 3), np.uint8), rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    red[..., 0] = 255
    messages = (
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "wrong"},
        {"role": "user", "content": "try again"},
        {"role": "assistant", "content": "right"},
    )
    ex = SFTExample(messages, (False, True), {}, images=(red, noise), image_messages=(0, 2))
    data = tokenise(vlm.tokenizer, [ex], 2048, vlm.processor)
    ids, mask, pv = data.ids[0], data.masks[0], data.vision[0]["pixel_values"]
    assert pv.shape[0] == 2 and _image_tokens(vlm, ids) == 2 * TOKENS_PER_IMAGE
    assert not torch.equal(pv[0], pv[1])  # in order: the red image first
    assert pv[0, 0].mean() > pv[0, 2].mean()  # red channel above blue
    assert vlm.tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "right<|im_end|>\n"
    # with a system prompt the images stay on their observations
    sys_ex = ex.with_system("Be brief.")
    assert sys_ex.image_messages == (1, 3) and sys_ex.messages[1]["content"] == "first"


def test_vision_examples_are_checked_and_stay_in_memory():
    ex = SFTExample(
        ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}),
        (True,),
        images=(np.zeros((4, 4, 3), np.uint8),),
        image_messages=(0,),
    )
    with pytest.raises(SFTDataError, match="not written to JSONL"):
        ex.to_dict()
    with pytest.raises(SFTDataError, match="do not point at user messages"):
        SFTExample(ex.messages, ex.trainable, images=ex.images, image_messages=(1,))
    with pytest.raises(ValueError, match="has no processor"):
        tokenise(tiny_policy(seed=0).tokenizer, [ex], 512)


def test_build_examples_keeps_images_and_the_system_prompt():
    (ex,) = build_examples("solver", ENV, {}, [3], system_prompt="Think.", images=True)
    assert ex.messages[0] == {"role": "system", "content": "Think."} and ex.image_messages == (1,)
    assert ex.meta["source"] == "solver"


def test_micro_batches_take_their_rows_images():
    batch = collate_tokens([[1, 2], [3, 4, 5], [6]], [[0, 1], [0, 1, 1], [0]])
    pv = torch.arange(3.0).view(3, 1)  # row 0 owns image 0, row 1 images 1 and 2, row 2 none
    batch = with_row_extras(batch, [{"pixel_values": pv[:1]}, {"pixel_values": pv[1:]}, {}])
    assert batch.extra_counts["pixel_values"].tolist() == [1, 2, 0]
    parts = list(minibatches(batch, 1))
    assert [p.extras["pixel_values"].view(-1).tolist() for p in parts] == [[0.0], [1.0, 2.0], []]
    (b,) = minibatches(batch.select(torch.tensor([2, 1])), 2)
    assert b.extras["pixel_values"].view(-1).tolist() == [1.0, 2.0]


def _vision_examples() -> list[SFTExample]:
    demos = demonstration_examples(ENV, {"max_attempts": 2}, [0, 1], images=True)
    rng = np.random.default_rng(1)
    two = SFTExample(
        (
            {"role": "user", "content": "Read the cards."},
            {"role": "assistant", "content": "A, 2"},
            {"role": "user", "content": "Again."},
            {"role": "assistant", "content": "3, 4, 5"},
        ),
        (True, True),
        images=tuple(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(2)),
        image_messages=(0, 2),
    )
    return [*demos, two]


def _one_step(micro, lr=1e-9):
    policy = tiny_policy(vision=True, seed=4)
    captured: dict[str, torch.Tensor] = {}

    def grab(_opt, _args, _kwargs):
        captured.update({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})

    handle = register_optimizer_step_pre_hook(grab)
    try:
        out = train_sft(
            policy,
            _vision_examples(),
            steps=1,
            lr=lr,
            batch_size=3,
            micro_batch_size=micro,
            max_len=2048,
            tensorboard=False,
        )
    finally:
        handle.remove()
    return policy, out, captured


def test_one_vision_sft_step_moves_the_weights_and_images_reach_the_model():
    before = {n: p.detach().clone() for n, p in tiny_policy(vision=True, seed=4).model.named_parameters()}
    policy, out, grads = _one_step(None, lr=1e-3)
    assert out["skipped_nonfinite"] == 0 and np.isfinite(out["loss_first"]) and out["examples"] == 3
    after = dict(policy.model.named_parameters())
    vision = [n for n in grads if "vision_tower" in n or "multi_modal_projector" in n]
    assert vision and all(grads[n].abs().sum() > 0 for n in vision)  # gradient flows through the images
    assert all(not torch.equal(after[n], before[n]) for n in vision)
    assert not policy.model.training


def test_vision_micro_batches_give_the_full_batch_loss_and_gradient():
    _, full, g_full = _one_step(None)
    _, micro, g_micro = _one_step(1)
    assert micro["loss_first"] == pytest.approx(full["loss_first"], rel=1e-5)
    for name, g in g_full.items():
        torch.testing.assert_close(g_micro[name], g, rtol=1e-4, atol=1e-6)


def test_the_vision_config_warms_up_a_vlm_on_image_examples(vlm, tmp_path):
    from veriloop.algos.sft.train import warmup_from_config
    from veriloop.configs.loader import load_config

    cfg = load_config(
        "configs/experiments/points24_vision_grpo.yaml",
        ["sft.steps=1", "sft.examples=2", "train.micro_batch_size=1", "run.tensorboard=false"],
    )
    assert cfg.sft.source == "solver"
    seen = []
    real = vlm.model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pixel_values"))
        return real(*args, **kwargs)

    vlm.model.forward = spy
    try:
        out = warmup_from_config(cfg, vlm)
    finally:
        del vlm.model.forward
    assert out["examples"] == 2 and out["steps_done"] == 1
    assert [None if p is None else tuple(p.shape) for p in seen] == [(1, 3, 32, 32)] * 2  # one image per row
