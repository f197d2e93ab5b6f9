"""Collation into right-padded token batches and mini-batching."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from veriloop.algos.learner.batch import TokenBatch, collate, collate_tokens, minibatches


def _two(make_traj):
    a = make_traj([([10, 11], [20], 1.0), ([12], [], 0.0)])  # 3 prompt + 2 + 1 env + 1 = 7 tokens
    b = make_traj([([13], [], -1.0)], group_id=1)  # 4 tokens
    return a, b


def test_collate_right_pads_and_masks(make_traj):
    a, b = _two(make_traj)
    adv = [[0, 0, 0, 1, 1, 9, 2], [0, 0, 0, -1]]
    batch = collate([a, b], adv, pad_id=63)
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 20, 12], [1, 2, 3, 13, 63, 63, 63]]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0, 0]]
    assert batch.turn_index.tolist() == [[-1, -1, -1, 0, 0, 0, 1], [-1, -1, -1, 0, -1, -1, -1]]
    assert batch.advantages.tolist() == [[0, 0, 0, 1, 1, 0, 2], [0, 0, 0, -1, 0, 0, 0]]  # 9 was off-mask
    assert batch.old_logprobs.tolist()[1] == [0, 0, 0, -1, 0, 0, 0]
    dropped = collate([a, b], adv, sample_mask=torch.tensor([1.0, 0.0]))
    assert dropped.loss_mask[1].sum() == 0 and dropped.advantages[1].abs().sum() == 0


def test_collate_tokens_pads_right_like_collate(make_traj):
    """SFT's batches: the same padding as a rollout's, no turns, zero log-probs and advantages."""
    out = collate_tokens([[5, 6, 7], [8]], [[0, 1, 1], [0]], pad_id=0)
    assert out.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out.loss_mask.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert out.loss_mask.dtype == torch.float32 and out.input_ids.dtype == torch.long
    assert out.turn_index.tolist() == [[-1] * 3] * 2
    assert out.old_logprobs.abs().sum() == 0 and out.advantages.abs().sum() == 0
    # invariant: a trajectory's tokens and loss mask collate to the same tensors either way
    a, b = _two(make_traj)
    rollout = collate([a, b], [[0.0] * len(t.token_ids) for t in (a, b)], pad_id=63)
    plain = collate_tokens([a.token_ids, b.token_ids], [a.loss_mask, b.loss_mask], pad_id=63)
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(getattr(plain, name), getattr(rollout, name)), name


def test_collate_tokens_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="row 1: 1 token ids but 2 loss-mask entries"):
        collate_tokens([[5, 6], [7]], [[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="got 0 and 0"):
        collate_tokens([], [])


def test_collate_tensor_advantages_and_shape_errors(make_traj):
    a, b = _two(make_traj)
    batch = collate([a, b], torch.ones(2, 9))
    assert batch.advantages.shape == (2, 7)
    with pytest.raises(ValueError, match=r"\[2, >= 7\]"):
        collate([a, b], torch.ones(2, 5))
    with pytest.raises(ValueError, match="expected input_ids"):
        replace(batch, loss_mask=torch.ones(2, 3))


def test_minibatches_and_extras(make_traj):
    a, b = _two(make_traj)
    a = replace(a, extras={"pixel_values": torch.zeros(1, 3)})
    b = replace(b, extras={"pixel_values": torch.ones(1, 3)})
    batch = collate([a, b, a], [[0.0] * 7, [0.0] * 4, [0.0] * 7])
    assert isinstance(batch, TokenBatch) and batch.extras["pixel_values"].shape == (3, 3)
    parts = list(minibatches(batch, 2))
    assert [p.size for p in parts] == [2, 1]
    assert (
        parts[0].extras["pixel_values"][1].sum() == 3
        and parts[1].input_ids.tolist() == batch.input_ids[2:].tolist()
    )
    shuffled = list(minibatches(batch, 1, shuffle=torch.Generator().manual_seed(0)))
    assert sorted(int(p.attention_mask.sum()) for p in shuffled) == [4, 7, 7]


def test_micro_batches_by_length_drop_shared_padding(make_traj):
    a, b = _two(make_traj)  # 7 and 4 tokens
    batch = collate([a, b, a, b], [[0.0] * 7, [0.0] * 4, [0.0] * 7, [0.0] * 4])
    assert batch.input_ids.shape == (4, 7)
    parts = list(minibatches(batch, 2, by_length=True))
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 4), (2, 7)]  # the short pair: 3 columns fewer
    short = parts[0]
    assert short.input_ids.tolist() == [batch.input_ids[1, :4].tolist()] * 2
    for f in ("attention_mask", "loss_mask", "old_logprobs", "turn_index", "advantages"):
        assert getattr(short, f).shape == (2, 4)
    assert batch.trimmed() is batch  # nothing to drop
    # every row and every loss token is still there
    assert sum(float(p.loss_mask.sum()) for p in parts) == float(batch.loss_mask.sum())


def test_micro_batches_keep_a_group_together(make_traj):
    """Rows sharing a prompt land in the same micro-batch, whatever order the batch came in."""
    p, q = (5, 6, 7, 8), (5, 6, 9, 9)
    rows = [make_traj([([10] * n, [], 0.0)], prompt=pr) for pr, n in ((p, 3), (q, 1), (p, 1), (q, 4))]
    batch = collate(rows, [[0.0] * len(t.token_ids) for t in rows])
    chunks = list(minibatches(batch, 2, by_length=True))
    for c in chunks:
        assert len({tuple(r[:4]) for r in c.input_ids.tolist()}) == 1  # one prompt per chunk
    assert sorted(int(c.attention_mask.sum()) for c in chunks) == [12, 13]  # (4+3, 4+1), (4+1, 4+4)


def test_micro_batches_capped_by_padded_tokens(make_traj):
    """``max_tokens`` bounds rows x longest row (activation memory); a longer single row still
    goes alone; every row is trained exactly once."""
    a, b = _two(make_traj)  # 7 and 4 tokens
    batch = collate([a, b, a, b, b], [[0.0] * 7, [0.0] * 4, [0.0] * 7, [0.0] * 4, [0.0] * 4])
    parts = list(minibatches(batch, 4, by_length=True, max_tokens=8))
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 4), (1, 4), (1, 7), (1, 7)]
    assert all(p.size * p.input_ids.shape[1] <= 8 or p.size == 1 for p in parts)
    assert sum(float(p.loss_mask.sum()) for p in parts) == float(batch.loss_mask.sum())
    uncapped = list(minibatches(batch, 4, by_length=True))
    assert [p.size for p in uncapped] == [4, 1]  # without the cap: by rows only
    assert [p.size for p in minibatches(batch, 4, by_length=True, max_tokens=100)] == [4, 1]


def test_select_takes_each_rows_own_images_when_episodes_have_several():
    """Multi-turn VLM episodes: pixel_values is [N_images, ...] (one per turn), not [B, ...]."""
    import torch

    from veriloop.algos.learner.batch import TokenBatch

    ids = torch.ones(3, 4, dtype=torch.long)
    z = torch.zeros(3, 4)
    pixels = torch.arange(6).float().view(6, 1)  # rows own 1, 3 and 2 images
    batch = TokenBatch(
        ids,
        ids,
        z,
        z,
        ids,
        z,
        extras={"pixel_values": pixels},
        extra_counts={"pixel_values": torch.tensor([1, 3, 2])},
    )
    part = batch.select(torch.tensor([2, 0]))
    assert part.extras["pixel_values"].view(-1).tolist() == [4.0, 5.0, 0.0]
    assert part.extra_counts["pixel_values"].tolist() == [2, 1]
    assert batch.select(slice(1, 2)).extras["pixel_values"].view(-1).tolist() == [1.0, 2.0, 3.0]
