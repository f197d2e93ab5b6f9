"""SFT loss, S2R masked SFT, and incremental chat-template examples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from veriloop.algos.sft.loss import build_sft_example, mask_turns, sft_loss
from veriloop.envs.solve_verify import s2r_trainable_actions


class CharChat:
    """ChatML rendering + one token per character: enough to check deltas and masks exactly."""

    def __init__(self, rewrite_history: bool = False):
        self.rewrite_history = rewrite_history

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        parts = []
        for i, m in enumerate(messages):
            content = m["content"]
            if self.rewrite_history and m["role"] == "assistant" and i < len(messages) - 1:
                content = content[:1]  # like templates that drop old <think> blocks
            parts.append(f"<{m['role']}>{content}|")
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


CHAT = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "ab"},
    {"role": "user", "content": "no"},
    {"role": "assistant", "content": "cd"},
]


def _trained_text(ids, mask):
    return "".join(chr(i) for i, m in zip(ids, mask) if m)


def test_build_sft_example_masks_assistant_turns():
    ids, mask = build_sft_example(CharChat(), CHAT)
    assert "".join(map(chr, ids)) == "<user>q|<assistant>ab|<user>no|<assistant>cd|"
    assert _trained_text(ids, mask) == "ab|cd|"  # content + end-of-turn marker, never the header
    ids, mask = build_sft_example(CharChat(), CHAT, trainable_turns=[False, True])
    assert _trained_text(ids, mask) == "cd|"
    with pytest.raises(ValueError, match="2 assistant messages"):
        build_sft_example(CharChat(), CHAT, trainable_turns=[True])
    with pytest.raises(ValueError, match="prefix-stable"):
        build_sft_example(CharChat(rewrite_history=True), CHAT)


def test_build_sft_example_with_real_chatml_tokenizer():
    from veriloop.agents.models.text import cache_root, is_complete

    if not is_complete(cache_root() / "tokenizers" / "SmolLM2"):
        pytest.skip("SmolLM2 tokenizer not cached")
    from veriloop.agents.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    ids, mask = build_sft_example(tok, CHAT, trainable_turns=[True, False])
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained.startswith("ab<|im_end|>") and "cd" not in trained


def test_s2r_trainable_actions_and_mask_turns():
    keep = s2r_trainable_actions(["solve", "verify", "solve", "verify"], [False, None, True, None])
    assert keep == [False, True, True, True]  # the wrong first solve is not imitated
    lm = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 1])
    tix = torch.tensor([-1, -1, 0, 0, 0, 1, 2, 2, 2, 3])
    assert mask_turns(lm, tix, keep).tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="solve"):
        s2r_trainable_actions(["think"], [None])  # type: ignore[list-item]


def test_sft_loss_is_token_mean_cross_entropy(tiny_llama):
    ids = torch.tensor([[1, 5, 7, 9, 11], [2, 4, 6, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    lm = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    loss, m = sft_loss(tiny_llama, ids, attn, lm)
    logits = tiny_llama(input_ids=ids, attention_mask=attn).logits[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="none").view(2, 4)
    want = (ce * lm[:, 1:]).sum() / lm.sum()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5) and m["tokens"] == 5
    loss.backward()
    with pytest.raises(ValueError, match="first token"):
        sft_loss(tiny_llama, ids, attn, torch.ones_like(lm))


def test_s2r_masked_sft_trains_verifications_and_the_correction_not_the_mistake(tiny_llama):
    """S2R behaviour initialisation on a solve -> verify -> solve -> verify trace: the wrong first
    solve is context only; both verifications and the final (right) solve are learned."""
    chat = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "S1"},  # wrong solve
        {"role": "user", "content": "v?"},
        {"role": "assistant", "content": "V1"},  # "incorrect": a right judgement
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "S2"},  # right solve: the correction
        {"role": "user", "content": "v?"},
        {"role": "assistant", "content": "V2"},  # "correct"
    ]
    keep = s2r_trainable_actions(["solve", "verify", "solve", "verify"], [False, None, True, None])
    ids, mask = build_sft_example(CharChat(), chat, trainable_turns=keep)
    assert _trained_text(ids, mask) == "V1|S2|V2|"
    # the SFT loss is the mean cross-entropy over exactly those 9 tokens (the mistake is context)
    x = torch.tensor([[i % 64 for i in ids]])
    lm = torch.tensor([mask])
    loss, m = sft_loss(tiny_llama, x, torch.ones_like(x), lm)
    logits = tiny_llama(input_ids=x).logits[0, :-1]
    ce = F.cross_entropy(logits, x[0, 1:], reduction="none")
    want = ce[lm[0, 1:].bool()].mean()
    assert m["tokens"] == len("V1|S2|V2|") and float(loss.detach()) == pytest.approx(
        float(want.detach()), rel=1e-5
    )
