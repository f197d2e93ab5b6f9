"""Vision-language policies: every turn's image reaches the model; save/load; LoRA reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from veriloop.agents.forward import token_logprobs
from veriloop.agents.loading import load_policy, save_policy
from veriloop.agents.testing import IMAGE_TOKEN, TINY_IMAGE_SIZE, TINY_PATCH_SIZE, tiny_policy
from veriloop.agents.vision import (
    count_images,
    encode_vision_messages,
    to_pil,
    user_content,
    vision_inputs,
    without_images,
)

TOKENS_PER_IMAGE = (TINY_IMAGE_SIZE // TINY_PATCH_SIZE) ** 2  # 16


def _image(seed: int, size=(40, 50)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def _conversation(images):
    """User turn with an image, assistant answer, ... (last turn awaits the assistant)."""
    messages = []
    for k, image in enumerate(images):
        if k:
            messages.append({"role": "assistant", "content": f"I see picture {k}."})
        messages.append({"role": "user", "content": user_content(f"Turn {k}: what now?", image)})
    return messages


def _count_image_tokens(policy, input_ids):
    return int((input_ids == policy.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).sum())


def test_three_turns_three_images_reach_the_model(tiny_vision_policy):
    policy = tiny_vision_policy
    enc = encode_vision_messages(policy.processor, _conversation([_image(k) for k in range(3)]))
    assert enc["input_ids"].shape[0] == 1
    assert _count_image_tokens(policy, enc["input_ids"]) == 3 * TOKENS_PER_IMAGE
    assert enc["pixel_values"].shape == (3, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE)
    logits = policy.model(**enc).logits  # [1, T, V]
    assert logits.shape[:2] == enc["input_ids"].shape and torch.isfinite(logits).all()
    logp, _ = token_logprobs(policy.model, enc["input_ids"], enc["attention_mask"], **vision_inputs(enc))
    assert logp.shape == enc["input_ids"].shape and (logp[:, 1:] < 0).all()


def test_first_turn_image_still_matters_on_the_last_turn(tiny_vision_policy):
    policy = tiny_vision_policy
    images = [_image(k) for k in range(3)]
    changed = [_image(99), *images[1:]]
    with torch.no_grad():
        last = policy.model(**encode_vision_messages(policy.processor, _conversation(images))).logits[0, -1]
        other = policy.model(**encode_vision_messages(policy.processor, _conversation(changed))).logits[0, -1]
    assert not torch.allclose(last, other, atol=1e-6)


def test_images_can_be_passed_separately_and_counts_must_match(tiny_vision_policy):
    processor = tiny_vision_policy.processor
    images = [_image(0), _image(1)]
    messages = without_images(_conversation(images))  # placeholders only, JSON-ready
    assert count_images(messages) == 2 and all("image" not in p for p in messages[0]["content"])
    inline = encode_vision_messages(processor, _conversation(images))
    separate = encode_vision_messages(processor, messages, images)
    assert torch.equal(inline["input_ids"], separate["input_ids"])
    torch.testing.assert_close(inline["pixel_values"], separate["pixel_values"])
    with pytest.raises(ValueError, match="2 image part.*1 image"):
        encode_vision_messages(processor, messages, images[:1])
    with pytest.raises(ValueError, match="carry no 'image'"):
        encode_vision_messages(processor, messages)


def test_generation_with_images(tiny_vision_policy):
    policy = tiny_vision_policy
    enc = encode_vision_messages(policy.processor, _conversation([_image(0), _image(1)]))
    out = policy.model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 3 and torch.equal(
        out[:, : enc["input_ids"].shape[1]], enc["input_ids"]
    )


def test_to_pil_accepts_arrays_and_rejects_bad_shapes():
    assert to_pil(np.zeros((4, 5), dtype=np.uint8)).size == (5, 4)
    assert to_pil(np.ones((4, 5, 3)) * 0.5).getpixel((0, 0)) == (128, 128, 128)
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        to_pil(np.zeros((2, 3, 4, 5)))


def test_vision_lora_reference_and_full_save_round_trip(tmp_path):
    lora = tiny_policy(vision=True, lora=True)
    enc = encode_vision_messages(lora.processor, _conversation([_image(0), _image(1)]))
    with torch.no_grad():
        base = lora.model(**enc).logits
        for name, param in lora.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
        with lora.reference() as ref:
            torch.testing.assert_close(ref(**enc).logits, base)

    full = tiny_policy(vision=True, seed=2)
    folder = save_policy(full, tmp_path / "vlm")
    loaded = load_policy(folder)
    assert loaded.is_vision and type(loaded.model).__name__ == type(full.model).__name__
    enc2 = encode_vision_messages(loaded.processor, _conversation([_image(0), _image(1)]))
    assert torch.equal(enc2["input_ids"], enc["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**enc2).logits, full.model(**enc2).logits)
