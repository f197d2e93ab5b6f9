"""The default-vision builder on a tiny budget: a real LLaVA that loads, saves, trains with LoRA.

The build here uses ``TINY_BUILD`` (tiny ViT, 2 + 2 steps) on a tiny random Llama with SmolLM2's
tokenizer, so it runs in seconds; the full build (``VisionBuildSettings()``) is the same code.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.models.card_reading import (
    caption,
    heldout_deals,
    read_ranks,
    recognition_scores,
    training_deals,
)
from veriloop.agents.models.vision import (
    IMAGE_TOKEN,
    REPORT_FILE,
    TINY_BUILD,
    VisionBuildSettings,
    align_loss,
    token_slots,
)
from veriloop.algos.learner.algorithm import resolve
from veriloop.envs.points24.cards import parse_code


def _hand(*codes: str) -> tuple:
    return tuple(parse_code(c) for c in codes)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from veriloop.agents.testing import _text_config, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-lm")
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(_text_config(tokenizer, len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def built(text_model, tmp_path_factory):
    from veriloop.agents.models.vision_build import build_vision_model

    out = tmp_path_factory.mktemp("vlm")
    lines: list[str] = []
    report = build_vision_model(out, TINY_BUILD, text_model=text_model, say=lines.append)
    return out, report, lines


# ---------------------------------------------------------------------------------- recognition metric
def test_read_ranks_and_caption():
    hand = _hand("AS", "10C", "QS", "7C")
    assert caption(hand) == "A, 10, Q, 7"
    assert read_ranks("A, 10, Q, 7") == ["A", "10", "Q", "7"]
    assert read_ranks("The cards: A, 10, Q and 7.") == ["A", "10", "Q", "7"]  # "The" is not a rank
    assert read_ranks("1, 0, 11") == []  # digits inside numbers are not ranks


def test_recognition_scores_hand_computed():
    deals = [_hand("AS", "10C", "QS", "7C"), _hand("2S", "3S", "4S", "5S")]
    scores = recognition_scores(["A, 10, Q, 7", "2, 3, 9"], deals)
    assert scores["all_four"] == 0.5  # second caption misses a card and misreads one
    assert scores["per_card"] == 6 / 8
    assert scores["by_position"] == [1.0, 1.0, 0.5, 0.5]
    assert scores["by_rank"]["4"] == 0.0 and scores["by_rank"]["A"] == 1.0 and "K" not in scores["by_rank"]
    assert recognition_scores(["7, Q, 10, A"], deals[:1])["all_four"] == 0.0  # order matters
    with pytest.raises(ValueError, match="one caption per deal"):
        recognition_scores(["A"], deals)


def test_heldout_deals_are_fixed_and_never_trained_on():
    held = heldout_deals(3, 50)
    assert held == heldout_deals(3, 50) and len(set(held)) == 50
    assert all(not c.is_red for d in held for c in d)
    assert all(c.is_red for d in heldout_deals(3, 5, "red") for c in d)
    train = training_deals(3, 7, 400, exclude=set(held))
    assert not set(train) & set(held) and train == training_deals(3, 7, 400, exclude=set(held))
    assert train != training_deals(3, 8, 400, exclude=set(held))


# ---------------------------------------------------------------------------------- objectives
def test_token_slots_follow_the_cards():
    assert token_slots(VisionBuildSettings(image_size=128, patch_size=32)).tolist() == [0, 1, 2, 3] * 4
    assert token_slots(VisionBuildSettings(image_size=128, patch_size=16)).tolist()[:8] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]


def test_align_loss_is_low_on_the_right_embeddings_and_high_on_wrong_ones():
    targets = torch.eye(13, 16) * 3  # [13, D] well separated
    ranks = torch.tensor([[0, 5, 12]])  # [B, N]
    right, acc = align_loss(targets[ranks], ranks, targets)
    wrong, acc_wrong = align_loss(targets[(ranks + 1) % 13], ranks, targets)
    assert acc == 1.0 and acc_wrong == 0.0 and right < 1e-3 < wrong
    with pytest.raises(ValueError, match="do not fit"):
        align_loss(targets[ranks], ranks[:, :2], targets)


# ---------------------------------------------------------------------------------- the built model
def test_build_writes_a_llava_with_the_text_models_weights(built, text_model):
    from transformers import AutoModelForImageTextToText, LlamaForCausalLM

    out, report, lines = built
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    lm = LlamaForCausalLM.from_pretrained(text_model)
    ours = model.model.language_model.state_dict()
    for name, weight in lm.model.state_dict().items():
        if name == "embed_tokens.weight":  # one extra row for <image>, a copy of <empty_output>
            assert torch.equal(ours[name][: len(weight)], weight)
            assert torch.equal(ours[name][-1], weight[16])
        else:
            assert torch.equal(ours[name], weight), name
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["heldout_black"]["n_deals"] == TINY_BUILD.eval_deals and "heldout_red" in saved
    assert saved == json.loads(json.dumps(report))
    assert any("stage 1/2 align: step 2/2" in line for line in lines)  # progress lines, one per line
    assert all("\r" not in line for line in lines)


def test_build_is_deterministic_from_the_seed(built, text_model, tmp_path):
    from safetensors.torch import load_file

    from veriloop.agents.models.vision_build import build_vision_model

    build_vision_model(tmp_path, TINY_BUILD, text_model=text_model, say=lambda _: None)
    first, again = load_file(built[0] / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_a_killed_build_resumes_to_the_same_model(built, text_model, tmp_path):
    from safetensors.torch import load_file

    from veriloop.agents.models.vision_build import build_vision_model

    class Killed(Exception):
        pass

    def die_at_stage_2(line: str) -> None:
        if "stage 2/2 caption: steps 0/" in line:
            raise Killed  # after stage 1's checkpoint was written

    resume = tmp_path / "resume.pt"
    with pytest.raises(Killed):
        build_vision_model(tmp_path, TINY_BUILD, text_model=text_model, resume=resume, say=die_at_stage_2)
    assert resume.is_file()
    lines: list[str] = []
    build_vision_model(tmp_path, TINY_BUILD, text_model=text_model, resume=resume, say=lines.append)
    assert any("resuming from" in line and "stage 1, step 0" in line for line in lines)
    assert not resume.exists()  # removed once the build finished
    first, again = load_file(built[0] / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_save_pretrained_round_trip(built, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from veriloop.agents.vision import encode_vision_messages, user_content
    from veriloop.envs.points24.render import render_cards

    out = built[0]
    model, processor = AutoModelForImageTextToText.from_pretrained(out), AutoProcessor.from_pretrained(out)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    again, processor2 = (
        AutoModelForImageTextToText.from_pretrained(tmp_path),
        AutoProcessor.from_pretrained(tmp_path),
    )
    image = render_cards(_hand("AS", "10C", "QS", "7C"))
    messages = [{"role": "user", "content": user_content("Which cards?", image)}]
    enc = encode_vision_messages(processor, messages)
    enc2 = encode_vision_messages(processor2, messages)
    assert torch.equal(enc["input_ids"], enc2["input_ids"])
    per_image = (TINY_BUILD.image_size // TINY_BUILD.patch_size) ** 2
    assert (
        int((enc["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).sum()) == per_image
    )
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, again(**enc2).logits)


def test_one_lora_rl_step_on_a_two_turn_vision_episode(built):
    """Rollout through the real engine (2 attempts, an image on every turn), then one GRPO step."""
    from veriloop.agents.engine import RolloutLimits, grouped_specs, rollout
    from veriloop.agents.loading import LoraSettings, load_policy
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.algos.learner.prepare import prepare_batch
    from veriloop.algos.learner.update import policy_loss
    from veriloop.configs.algo import AlgoConfig

    policy = load_policy(built[0], lora=LoraSettings(r=4, alpha=8))
    assert policy.is_vision and policy.is_lora
    image_id = policy.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    per_image = (TINY_BUILD.image_size // TINY_BUILD.patch_size) ** 2
    seen: list[tuple[int, list[int]]] = []  # per forward with pixels: (images, image tokens per row)
    forward = policy.model.forward

    def spy(*args, **kwargs):
        if kwargs.get("pixel_values") is not None:
            seen.append((kwargs["pixel_values"].shape[0], (kwargs["input_ids"] == image_id).sum(-1).tolist()))
        return forward(*args, **kwargs)

    policy.model.forward = spy
    try:
        specs = grouped_specs("veriloop/Points24-vision-v0", {"max_attempts": 2}, [0], 2)
        trajs = rollout(
            policy,
            specs,
            sampling=SamplingParams(max_new_tokens=6, seed=1),
            limits=RolloutLimits(max_turns=2),
        )
    finally:
        del policy.model.forward
    assert [t.num_turns for t in trajs] == [2, 2]
    assert seen == [(2 * k, [k * per_image] * 2) for k in (1, 2)]  # turn k: k images per episode
    cfg = AlgoConfig(advantage="rloo", kl_coef=0.0)
    batch, _ = prepare_batch(trajs, resolve(cfg), pad_id=policy.tokenizer.pad_token_id)
    # a random tiny model's two episodes usually score alike (zero advantage): set them apart
    batch = dataclasses.replace(batch, advantages=torch.tensor([[1.0], [-1.0]]) * batch.loss_mask)
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-2)
    loss, _ = policy_loss(policy.model, batch, resolve(cfg))
    loss.backward()
    optimizer.step()
    after = dict(policy.model.named_parameters())
    assert lora and all("lora_" in n for n in lora)
    assert any(not torch.equal(after[n], v) for n, v in lora.items())  # the adapter learned
    assert all(torch.equal(after[n], v) for n, v in frozen.items())  # nothing else moved
    assert np.isfinite(loss.item())


def test_the_shipped_vision_config_names_default_vision():
    from veriloop.configs.loader import load_config

    cfg = load_config("configs/experiments/points24_vision_grpo.yaml", [])
    assert cfg.policy.model == "default-vision" and cfg.env.id == "veriloop/Points24-vision-v0"
    # a short SFT warm-up on the solver's answers (image + text demonstrations) teaches the JSON format
    assert cfg.sft.source == "solver" and cfg.sft.steps > 0


def test_the_shipped_vision_config_trains_one_step_with_a_built_vlm(built, tmp_path):
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    overrides = [
        f"policy.model={built[0]}",
        "train.steps=1",
        "train.warmup_steps=0",
        "train.micro_batch_size=2",
        "rollout.prompts_per_step=1",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_context=512",
        "eval.every=0",
        "eval.num_problems=1",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        f"run.out_dir={tmp_path}",
        "run.name=vis",
        "run.tensorboard=false",
    ]
    train(load_config("configs/experiments/points24_vision_grpo.yaml", overrides), quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "vis" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the base evaluation, then the one training step
    assert (tmp_path / "vis" / "final").is_dir()
