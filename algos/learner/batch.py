"""Token batches: trajectories padded into [B, T] tensors for the update step.

Padding is on the RIGHT: row i holds its T_i tokens at positions 0..T_i-1, then ``pad_id`` with
attention_mask = loss_mask = 0. Right padding keeps token positions equal to the positions seen at
rollout time (position ids start at 0 on every row), so recorded log-probs line up with
``token_logprobs`` without shifting; causal attention never looks right, so pads do not change the
real tokens' outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from veriloop.agents.trajectory import Trajectory


@dataclass(frozen=True)
class TokenBatch:
    """A right-padded batch of B sequences of length T.

    Attributes:
        input_ids: [B, T] long token ids.
        attention_mask: [B, T] long, 1 on real tokens.
        loss_mask: [B, T] float, 1 on sampled tokens that train (0 on prompt, environment,
            padding and filtered episodes).
        old_logprobs: [B, T] float, sampling-policy log-probs (0 off the loss mask).
        turn_index: [B, T] long, turn of each token (-1 prompt and padding).
        advantages: [B, T] float, 0 off the loss mask.
        returns: [B, T] float value targets (critic only) or None.
        old_values: [B, T] float critic values at rollout time (critic only) or None.
        ref_logprobs: [B, T] float reference-policy log-probs (KL only) or None.
        sampler_logprobs: [B, T] float log-probs the sampler recorded (mu), kept when
            ``old_logprobs`` were recomputed by the trainer for rollout correction; else None.
        is_weights: [B, T] float rollout-correction weights (pi_old / mu, truncated or masked;
            ``algos.correction``) multiplying the policy loss; None = no correction.
        cov_select: [B, T] bool, the tokens Clip-Cov / KL-Cov act on, chosen once for the whole
            mini-batch before it is cut into micro-batches (``update.select_tokens``); else None.
        teacher_logprobs: [B, T] float, an on-policy distillation teacher's log-probs of the
            sampled tokens (``agents.teacher``; 0 off the loss mask), or None.
        episode_index: [B, T] long, the episode each row comes from (one value per row), set when
            rows split from one episode train as that one episode (``algo.split_weight="episode"``,
            ``prepare_batch``): the sequence losses and aggregations group them, and
            :func:`minibatches` / :func:`rank_rows` keep them together. None = a row is an episode.
        extras: extra model inputs (e.g. ``pixel_values``); tensors whose first dim is B are
            sliced with the batch.
        extra_counts: For an extra stacked per item rather than per row (a multi-turn VLM
            episode has one image per turn: ``pixel_values`` is [N_images, ...]), [B] long, how
            many leading entries each row owns, in row order; ``select`` takes each row's own.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    turn_index: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    cov_select: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    episode_index: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    extra_counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"input_ids must be [B, T], got {shape}")
        for f in ("attention_mask", "loss_mask", "old_logprobs", "turn_index", "advantages"):
            got = tuple(getattr(self, f).shape)
            if got != shape:
                raise ValueError(f"TokenBatch.{f} has shape {got}, expected input_ids' {shape}")
        optional = (
            "returns",
            "old_values",
            "ref_logprobs",
            "sampler_logprobs",
            "is_weights",
            "cov_select",
            "teacher_logprobs",
            "episode_index",
        )
        for f in optional:
            x = getattr(self, f)
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"TokenBatch.{f} has shape {tuple(x.shape)}, expected {shape}")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def trimmed(self) -> TokenBatch:
        """The same rows without the trailing columns that are padding in every row.

        A mini-batch cut from a padded batch keeps the batch's width; its own longest row is
        often much shorter, and every padding column still costs a full forward/backward column.
        """
        used = self.attention_mask.bool().any(0).nonzero()  # [n, 1] columns with a real token
        width = int(used[-1]) + 1 if len(used) else 1
        if width == self.input_ids.shape[1]:
            return self
        vals = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extras"}
        cut: dict[str, Any] = {k: v[:, :width] if isinstance(v, torch.Tensor) else v for k, v in vals.items()}
        return TokenBatch(**cut, extras=self.extras)

    def select(self, rows: slice | torch.Tensor) -> TokenBatch:
        """Rows of the batch (a slice or an index tensor), extras included."""
        b = self.size

        def pick(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x[rows]
            return x

        extras, counts = {}, {}
        for k, v in self.extras.items():
            if k in self.extra_counts:  # [N_items, ...]: each selected row's own items, in order
                own = self.extra_counts[k]  # [B]
                starts = torch.cumsum(own, 0) - own
                idx = torch.arange(b)[rows]
                items = [torch.arange(int(starts[i]), int(starts[i] + own[i])) for i in idx.tolist()]
                extras[k] = v[torch.cat(items)] if items else v[:0]
                counts[k] = own[idx]
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b:
                extras[k] = v[rows]
            else:
                raise ValueError(
                    f"cannot split extras[{k!r}] by rows (its first dim is not B={b}, and no per-row counts); "
                    "use a mini-batch size equal to the batch size for this model"
                )
        skip = ("extras", "extra_counts")
        vals = {f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip}
        return TokenBatch(**vals, extras=extras, extra_counts=counts)


def _pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, length: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def _pad_tokens(
    ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padding both collates share: ``input_ids``, ``attention_mask`` (long) and ``loss_mask``
    (float32), each [B, T] with T the longest sequence, real tokens first (right padding)."""
    t_max = max(len(x) for x in ids)
    input_ids = _pad(ids, pad_id, torch.long, t_max)  # [B, T]
    attention_mask = _pad([[1] * len(x) for x in ids], 0, torch.long, t_max)  # [B, T]
    loss_mask = _pad(loss_masks, 0, torch.float32, t_max)  # [B, T]
    return input_ids, attention_mask, loss_mask


def collate_tokens(
    ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]], *, pad_id: int = 0
) -> TokenBatch:
    """Pad plain token sequences and their loss masks into a ``TokenBatch`` (SFT's batches).

    The same padding as :func:`collate`, for data that is not a rollout: ``old_logprobs`` and
    ``advantages`` are 0 and ``turn_index`` is -1 (no sampled turns); the loss mask is the one given.

    Args:
        ids: B token-id lists. loss_masks: B lists of the same lengths, 1 on tokens to learn.
        pad_id: Token id for padding (never attended, never trained).
    """
    if not ids or len(ids) != len(loss_masks):
        raise ValueError(
            f"collate_tokens needs B >= 1 rows of ids and B loss masks, got {len(ids)} and {len(loss_masks)}"
        )
    bad = [b for b, (x, m) in enumerate(zip(ids, loss_masks)) if len(x) != len(m)]
    if bad:
        b = bad[0]
        raise ValueError(f"row {b}: {len(ids[b])} token ids but {len(loss_masks[b])} loss-mask entries")
    input_ids, attention_mask, loss_mask = _pad_tokens(ids, loss_masks, pad_id)
    zeros = torch.zeros_like(loss_mask)  # [B, T]
    no_turn = torch.full_like(input_ids, -1)  # [B, T]
    return TokenBatch(
        input_ids, attention_mask, loss_mask, old_logprobs=zeros, turn_index=no_turn, advantages=zeros
    )


def with_row_extras(batch: TokenBatch, per_row: Sequence[dict[str, torch.Tensor]]) -> TokenBatch:
    """``batch`` with per-row model inputs attached (e.g. each SFT example's ``pixel_values``).

    Row b's tensors (first dim = its item count, 0 or more images) are stacked along dim 0 in row
    order into ``extras[k]`` [N_items, ...], with ``extra_counts[k]`` [B] saying how many each row
    owns, so :meth:`TokenBatch.select` (micro-batches) takes each row's own items. A row without
    key k owns 0 of them.
    """
    if len(per_row) != batch.size:
        raise ValueError(f"{len(per_row)} rows of extras for a batch of {batch.size} rows")
    keys = sorted(set().union(*(r.keys() for r in per_row))) if per_row else []
    extras: dict[str, Any] = {}
    counts: dict[str, torch.Tensor] = {}
    for k in keys:
        tensors = [r[k] for r in per_row if k in r]
        extras[k] = torch.cat(tensors, dim=0)  # [N_items, ...]
        counts[k] = torch.tensor(
            [int(r[k].shape[0]) if k in r else 0 for r in per_row], dtype=torch.long
        )  # [B]
    return dataclasses.replace(batch, extras=extras, extra_counts=counts)


def _collate_extras(trajectories: Sequence[Trajectory]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Extras stacked along dim 0 in trajectory order, and how many entries each trajectory gave."""
    keys = set().union(*(t.extras.keys() for t in trajectories)) if trajectories else set()
    out: dict[str, Any] = {}
    counts: dict[str, torch.Tensor] = {}
    for k in sorted(keys):
        vals = [t.extras.get(k) for t in trajectories]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len(tensors) != len(vals):
            raise ValueError(f"extras[{k!r}] must be a tensor on every trajectory to be collated")
        out[k] = torch.cat(tensors, dim=0)  # stacked on dim 0
        counts[k] = torch.tensor([v.shape[0] for v in tensors], dtype=torch.long)  # [B]
    return out, counts


def collate(
    trajectories: Sequence[Trajectory],
    advantages_per_token: torch.Tensor | Sequence[Sequence[float]],
    *,
    pad_id: int = 0,
    sample_mask: torch.Tensor | None = None,
) -> TokenBatch:
    """Pad trajectories into a ``TokenBatch`` (right padding).

    Args:
        trajectories: N episodes.
        advantages_per_token: [N, T'] tensor (T' >= longest episode, extra columns ignored) or one
            list per trajectory of its token advantages.
        pad_id: Token id for padding (never attended, never trained).
        sample_mask: [N] 1 keep / 0 drop an episode from the loss (overlong filter, verifier failure).

    Extras (e.g. pixel values) are concatenated along dim 0 in trajectory order.
    """
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    n = len(trajectories)
    for t in trajectories:
        if not (len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.turn_index)):
            raise ValueError(f"trajectory (group {t.group_id}) has per-token lists of different lengths")
    ids, masks = [t.token_ids for t in trajectories], [t.loss_mask for t in trajectories]
    input_ids, attn, loss_mask = _pad_tokens(ids, masks, pad_id)  # [N, T] each
    t_max = input_ids.shape[1]
    if sample_mask is not None:
        if sample_mask.shape != (n,):
            raise ValueError(f"sample_mask must be [{n}], got {tuple(sample_mask.shape)}")
        loss_mask = loss_mask * sample_mask.to(torch.float32).unsqueeze(1)
    old_lp = _pad([t.logprobs for t in trajectories], 0.0, torch.float32, t_max) * loss_mask
    turn_index = _pad([t.turn_index for t in trajectories], -1, torch.long, t_max)
    if isinstance(advantages_per_token, torch.Tensor):
        if (
            advantages_per_token.dim() != 2
            or advantages_per_token.shape[0] != n
            or advantages_per_token.shape[1] < t_max
        ):
            raise ValueError(f"advantages must be [{n}, >= {t_max}], got {tuple(advantages_per_token.shape)}")
        adv = advantages_per_token[:, :t_max].to(torch.float32)
    else:
        if len(advantages_per_token) != n:
            raise ValueError(f"got {len(advantages_per_token)} advantage rows for {n} trajectories")
        adv = _pad(advantages_per_token, 0.0, torch.float32, t_max)
    extras, extra_counts = _collate_extras(trajectories)
    return TokenBatch(
        input_ids=input_ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        old_logprobs=old_lp,
        turn_index=turn_index,
        advantages=adv * loss_mask,
        extras=extras,
        extra_counts=extra_counts,
    )


@dataclass(frozen=True)
class SampleRows:
    """The training rows of a rollout batch: one per *sample* of each episode.

    An episode whose every turn extended the previous context is one sample, one row: then the
    rows are the episodes and every method below returns its input unchanged. An episode split
    where its chat template rewrote history or a compactor shortened it (``Trajectory.sample_starts``)
    gives one row per sample, each a whole context the model is run on. Advantages stay an
    *episode* matter: they are computed on the episode view ``[N, T_ep]`` (the samples' tokens
    one after another, so per-turn credit follows ``turn_index`` as before) and moved to the rows.

    Attributes:
        episode: [R] the trajectory each row comes from.
        start: [R] where the row begins in its trajectory's ``token_ids``.
        length: [R] the row's number of tokens.
    """

    episode: tuple[int, ...]
    start: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> SampleRows:
        spans = [(i, a, b - a) for i, t in enumerate(trajectories) for a, b in t.samples()]
        return cls(*(tuple(x) for x in zip(*spans))) if spans else cls((), (), ())

    @property
    def identity(self) -> bool:
        """One row per episode (nothing was split)."""
        return self.episode == tuple(range(len(self.episode)))

    def pieces(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """One trajectory per row: the sample's per-token lists (its turns are the episode's)."""
        if self.identity:
            return list(trajectories)
        out = []
        for i, a, n in zip(self.episode, self.start, self.length):
            t = trajectories[i]
            if t.extras:
                raise ValueError(
                    "a split episode cannot carry extras (images): vision episodes are one sample"
                )
            out.append(
                dataclasses.replace(
                    t,
                    token_ids=t.token_ids[a : a + n],
                    loss_mask=t.loss_mask[a : a + n],
                    logprobs=t.logprobs[a : a + n],
                    turn_index=t.turn_index[a : a + n],
                    sample_starts=(0,),
                    split_reasons=(),
                    turns=(),
                )
            )
        return out

    @overload
    def to_rows(self, x: torch.Tensor, width: int) -> torch.Tensor: ...
    @overload
    def to_rows(self, x: None, width: int) -> None: ...

    def to_rows(self, x: torch.Tensor | None, width: int) -> torch.Tensor | None:
        """Episode view ``[N, T_ep]`` -> rows ``[R, width]`` (each row its sample's columns)."""
        if x is None or self.identity:
            return x
        out = x.new_zeros((len(self.episode), width))  # [R, width]
        for r, (i, a, n) in enumerate(zip(self.episode, self.start, self.length)):
            out[r, :n] = x[i, a : a + n]
        return out

    @overload
    def to_episodes(self, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor: ...
    @overload
    def to_episodes(self, x: None, shape: tuple[int, int]) -> None: ...

    def to_episodes(self, x: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
        """Rows ``[R, T]`` -> episode view ``shape = (N, T_ep)``: the inverse of :meth:`to_rows`."""
        if x is None or self.identity:
            return x
        out = x.new_zeros(shape)  # [N, T_ep]
        for r, (i, a, n) in enumerate(zip(self.episode, self.start, self.length)):
            out[i, a : a + n] = x[r, :n]
        return out

    def episode_view(
        self, rows: TokenBatch, trajectories: Sequence[Trajectory], pad_id: int = 0
    ) -> TokenBatch:
        """The ``[N, T_ep]`` batch advantages are computed on, with the rows' ``old_logprobs``
        (recorded or recomputed) moved into it; ``rows`` itself when nothing was split."""
        if self.identity:
            return rows
        view = collate(trajectories, [[0.0] * len(t.token_ids) for t in trajectories], pad_id=pad_id)
        n, t_ep = view.loss_mask.shape
        old = self.to_episodes(rows.old_logprobs, (int(n), int(t_ep)))
        return dataclasses.replace(view, old_logprobs=old)


def with_advantages(base: TokenBatch, advantages: torch.Tensor, sample_mask: torch.Tensor) -> TokenBatch:
    """``base`` (collated with zero advantages) with its advantages and sample mask attached: the
    same batch ``collate(trajectories, advantages, sample_mask=...)`` builds, without collating again.

    Args:
        advantages: [N, T'] (T' >= T, extra columns ignored); sample_mask: [N] 1 keep / 0 drop.
    """
    n, t_max = base.loss_mask.shape
    if sample_mask.shape != (n,):
        raise ValueError(f"sample_mask must be [{n}], got {tuple(sample_mask.shape)}")
    if advantages.dim() != 2 or advantages.shape[0] != n or advantages.shape[1] < t_max:
        raise ValueError(f"advantages must be [{n}, >= {t_max}], got {tuple(advantages.shape)}")
    keep = sample_mask.to(torch.float32).unsqueeze(1)  # [N, 1]
    loss_mask = base.loss_mask * keep  # [N, T]
    return dataclasses.replace(
        base,
        loss_mask=loss_mask,
        old_logprobs=base.old_logprobs * keep,  # base's are already 0 off its loss mask
        advantages=advantages[:, :t_max].to(torch.float32) * loss_mask,
    )


def minibatches(
    batch: TokenBatch,
    size: int,
    *,
    shuffle: torch.Generator | None = None,
    by_length: bool = False,
    max_tokens: int = 0,
) -> Iterator[TokenBatch]:
    """Consecutive row chunks of at most ``size`` rows (a random order if a generator is given).

    ``by_length``: for gradient-accumulation micro-batches, whose order does not change the summed
    gradient but whose make-up costs compute. Rows are ordered by prompt (the tokens before the
    first sampled one), then by length: a group's rows land in the same chunk, where they share
    the prompt's forward pass (``token_logprobs(shared_prefix=...)``), and each chunk is trimmed
    to its own longest row (see :meth:`TokenBatch.trimmed`). ``max_tokens`` (with ``by_length``)
    also ends a chunk before its rows x longest row would pass it (0 = no cap).

    With ``batch.episode_index`` the rows of one episode stay in one chunk (they are one sequence):
    the episodes are ordered (shuffled, or by their first row's place in the order above) and a
    chunk takes whole episodes, so an episode of more samples than ``size`` is a chunk of its own.
    """
    if size < 1:
        raise ValueError(f"mini-batch size must be >= 1, got {size}")
    if by_length:
        lengths = batch.attention_mask.sum(1).tolist()
        firsts = batch.loss_mask.bool().int().argmax(1).tolist()  # 0 for a row with nothing to train
        prompts = [tuple(batch.input_ids[i, :f].tolist()) for i, f in enumerate(firsts)]
        order = torch.tensor(
            sorted(range(batch.size), key=lambda i: (prompts[i], lengths[i])), dtype=torch.long
        )
    else:
        order = torch.arange(batch.size)
    units = _units(batch, order)
    if shuffle is not None and not by_length:  # a random order of the episodes (rows, without episodes)
        units = [units[u] for u in torch.randperm(len(units), generator=shuffle).tolist()]
    cap = by_length and max_tokens > 0
    # each row's width once trimmed (right padding: one past its last real token)
    ends = (batch.attention_mask.shape[1] - batch.attention_mask.flip(1).int().argmax(1)).tolist()
    chunk: list[int] = []
    widest = 0  # the chunk's widest row
    for unit in units:
        own = max(ends[i] for i in unit)
        width = max(widest, own)
        n = len(chunk) + len(unit)
        if chunk and (n > size or (cap and n * width > max_tokens)):
            yield _rows(batch, chunk, by_length)
            chunk, width = [], own
        chunk.extend(unit)
        widest = width
    if chunk:
        yield _rows(batch, chunk, by_length)


def _units(batch: TokenBatch, order: torch.Tensor) -> list[list[int]]:
    """The rows in ``order``, gathered by episode (``batch.episode_index``): one list per episode,
    in the order of its first row, its rows in ``order``; without it, one list per row."""
    if batch.episode_index is None:
        return [[i] for i in order.tolist()]
    episode = batch.episode_index[:, 0].tolist()
    units: dict[int, list[int]] = {}
    for i in order.tolist():
        units.setdefault(int(episode[i]), []).append(i)
    return list(units.values())


def rank_rows(batch: TokenBatch, rank: int, world: int) -> TokenBatch:
    """Data parallelism: rank ``rank``'s rows of ``batch``, every ``world``-th row from ``rank``
    on, or with ``batch.episode_index`` every ``world``-th episode (its rows stay together)."""
    units = _units(batch, torch.arange(batch.size))
    rows = [i for u in units[rank::world] for i in u]
    return batch.select(torch.tensor(rows, dtype=torch.long))


def _rows(batch: TokenBatch, rows: list[int], trim: bool) -> TokenBatch:
    part = batch.select(torch.tensor(rows, dtype=torch.long))
    return part.trimmed() if trim else part


def with_teacher(batch: TokenBatch, teacher: Sequence[Sequence[float]]) -> TokenBatch:
    """``batch`` with a distillation teacher's log-probs attached (``TokenBatch.teacher_logprobs``).

    Args:
        teacher: One list per row, as long as the row's tokens (``agents.teacher.teacher_logprobs``:
            the episodes' own positions; one row per episode).
    """
    if len(teacher) != batch.size:
        raise ValueError(
            f"{len(teacher)} teacher rows for a batch of {batch.size} (one row per one-sample episode)"
        )
    width = batch.input_ids.shape[1]
    if any(len(row) > width for row in teacher):
        raise ValueError(f"a teacher row is longer than the batch's {width} columns")
    return dataclasses.replace(
        batch, teacher_logprobs=_pad(teacher, 0.0, torch.float32, width) * batch.loss_mask
    )
