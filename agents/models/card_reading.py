"""Reading Points24 cards from images: the captioning data and the recognition metric.

The default vision model (:mod:`veriloop.agents.models.vision`) learns to read cards from one
captioning task, rendered by the Points24 environment's own renderer::

    user:      <image> + CAPTION_PROMPT
    assistant: "A, 8, 5, 10"        the four ranks, left to right (caption(cards))

Suits are left out of the caption: Points24 asks for ranks only, and leaving them out keeps the red
suits (visual OOD) unseen as pictures *and* as words. J, Q and K are drawn as their letters ("faces")
and captioned as letters.

Deals come from seeded ``numpy`` generators only (never the global RNG): the held-out deals of a
seed are drawn first and every training deal equal to one of them is skipped, so "held-out" means
no training image ever showed that hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from veriloop.envs.points24.cards import RANK_NAMES, Card, SuitSet, deal

#: The question every caption answers (training and evaluation use the same words).
CAPTION_PROMPT = "Which cards are shown? List their ranks from left to right."
#: A rank as a whole word: ``10`` before single digits, letters only on their own.
_RANK = re.compile(r"(?<![0-9A-Za-z])(10|[2-9]|A|J|Q|K)(?![0-9A-Za-z])")
#: Stream ids mixed into the seed so the streams never overlap.
_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1
_SUIT_STREAMS = {"black": 0, "red": 1, "any": 2}

Deal = tuple[Card, ...]


def caption(cards: Sequence[Card]) -> str:
    """The target text for a deal: ranks left to right, ``"A, 8, 5, 10"``."""
    return ", ".join(c.name for c in cards)


def read_ranks(text: str) -> list[str]:
    """Rank names in a model's caption, in order (``"A, 8, 5, 10"`` -> ``["A", "8", "5", "10"]``)."""
    return _RANK.findall(text)


def heldout_deals(seed: int, n: int, suits: SuitSet = "black") -> list[Deal]:
    """``n`` distinct deals for evaluation, a fixed function of ``(seed, suits)``."""
    rng = np.random.default_rng([seed, _HELDOUT_STREAM, _SUIT_STREAMS[suits]])
    out: list[Deal] = []
    seen: set[Deal] = set()
    while len(out) < n:
        hand = deal(rng, 4, suits)
        if hand not in seen:
            seen.add(hand)
            out.append(hand)
    return out


def training_deals(seed: int, step: int, n: int, exclude: set[Deal], suits: SuitSet = "black") -> list[Deal]:
    """The ``n`` black-suit training deals of one step: a fixed function of ``(seed, step)``, so a
    resumed build sees the same data. Deals in ``exclude`` (the held-out ones) are skipped."""
    rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
    out: list[Deal] = []
    while len(out) < n:
        hand = deal(rng, 4, suits)
        if hand not in exclude:
            out.append(hand)
    return out


def render_deals(deals: Sequence[Deal]) -> list[Any]:
    """PIL images of the deals, drawn by the environment's renderer (``render_cards``)."""
    from veriloop.agents.vision import to_pil
    from veriloop.envs.points24.render import render_cards

    return [to_pil(render_cards(d)) for d in deals]


def batches(deals: Sequence[Deal], size: int) -> Iterator[Sequence[Deal]]:
    """Consecutive chunks of at most ``size`` deals."""
    for start in range(0, len(deals), size):
        yield deals[start : start + size]


def recognition_scores(captions: Sequence[str], deals: Sequence[Deal]) -> dict[str, Any]:
    """How well ``captions`` read ``deals`` (one caption per deal, same order).

    Returns:
        ``all_four``: share of deals whose caption names exactly the four ranks, in order.
        ``per_card``: share of cards read right (card i against the caption's i-th rank; a
        missing rank is wrong).
        ``by_position``: ``per_card`` for each of the four positions, left to right.
        ``by_rank``: ``per_card`` for each rank name (``"A"`` .. ``"K"``) among the dealt cards.
        ``n_deals``: how many deals were scored.
    """
    if len(captions) != len(deals):
        raise ValueError(
            f"recognition_scores needs one caption per deal, got {len(captions)} and {len(deals)}"
        )
    if not deals:
        raise ValueError("recognition_scores needs at least one deal")
    hits = np.zeros((len(deals), 4), dtype=bool)  # [N, 4] card i of deal n read right
    exact = 0
    for n, (text, hand) in enumerate(zip(captions, deals)):
        read = read_ranks(text)
        truth = [c.name for c in hand]
        exact += read == truth
        hits[n] = [i < len(read) and read[i] == name for i, name in enumerate(truth)]
    names = np.array([[c.name for c in hand] for hand in deals])  # [N, 4]
    by_rank = {r: float(hits[names == r].mean()) for r in RANK_NAMES if (names == r).any()}
    return {
        "all_four": exact / len(deals),
        "per_card": float(hits.mean()),
        "by_position": [float(x) for x in hits.mean(0)],
        "by_rank": by_rank,
        "n_deals": len(deals),
    }
