"""Playing cards for Points24: ranks, suits, face-card rules and dealing with ``np_random``."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

FaceRule = Literal["10", "11-12-13"]
SuitSet = Literal["black", "red", "any"]

RANK_NAMES = ("A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K")
SUITS = ("S", "C", "H", "D")  # spades, clubs, hearts, diamonds
SUIT_SYMBOLS = {"S": "♠", "C": "♣", "H": "♥", "D": "♦"}
SUIT_SETS: dict[str, tuple[str, ...]] = {"black": ("S", "C"), "red": ("H", "D"), "any": SUITS}
FACE_RULES: tuple[str, ...] = ("10", "11-12-13")
ALL_RANKS: tuple[int, ...] = tuple(range(1, 14))
#: Ranks whose value depends on the face-card rule (J, Q, K).
FACE_RANKS = frozenset({11, 12, 13})


@dataclass(frozen=True, order=True)
class Card:
    """A card: ``rank`` 1 (ace) .. 13 (king) and ``suit`` one of ``S C H D``."""

    rank: int
    suit: str

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 13 or self.suit not in SUITS:
            raise ValueError(
                f"invalid card rank={self.rank!r} suit={self.suit!r}: rank 1..13, suit in {SUITS}"
            )

    @property
    def name(self) -> str:
        """Rank name: ``A``, ``2`` .. ``10``, ``J``, ``Q``, ``K``."""
        return RANK_NAMES[self.rank - 1]

    @property
    def is_red(self) -> bool:
        return self.suit in ("H", "D")

    def label(self) -> str:
        """Human label with suit symbol, e.g. ``Q♠``."""
        return f"{self.name}{SUIT_SYMBOLS[self.suit]}"

    def code(self) -> str:
        """ASCII code, e.g. ``QS`` / ``10H`` (inverse of :func:`parse_code`)."""
        return f"{self.name}{self.suit}"


def parse_code(code: str) -> Card:
    """``"QS"`` / ``"10h"`` / ``"A♣"`` -> :class:`Card`."""
    text = code.strip().upper()
    for suit, symbol in SUIT_SYMBOLS.items():
        text = text.replace(symbol, suit)
    rank_name, suit = text[:-1], text[-1:]
    if rank_name not in RANK_NAMES or suit not in SUITS:
        raise ValueError(
            f"cannot read card {code!r}: expected rank {RANK_NAMES} then suit {SUITS}, e.g. 'QS'"
        )
    return Card(RANK_NAMES.index(rank_name) + 1, suit)


def check_rule(face_cards: str) -> FaceRule:
    if face_cards not in FACE_RULES:
        raise ValueError(f"face_cards must be one of {FACE_RULES}, got {face_cards!r}")
    return face_cards  # type: ignore[return-value]


def card_value(rank: int, face_cards: FaceRule) -> int:
    """Number a card stands for: ace 1, 2..10 as printed, J/Q/K 10 (``"10"``) or 11/12/13."""
    if rank <= 10 or face_cards == "11-12-13":
        return rank
    return 10


def check_ranks(ranks: Sequence[object] | None) -> tuple[int, ...]:
    """The sorted ranks (1..13) a deck holds, from names or numbers: ``["A", 2, "3", "J"]`` -> ``(1, 2, 3, 11)``.

    ``None`` means all thirteen, A..K. Raises ``ValueError`` naming the bad entry and the fix for a
    string instead of a list, an unknown rank (with the closest name), a repeated rank or an empty list.
    """
    if ranks is None:
        return ALL_RANKS
    example = "['A', '2', '3', '4', '5', '6'] (A..6), or leave it out for all of A..K"
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise ValueError(f"ranks must be a list of card ranks such as {example}; got {ranks!r}")
    out: list[int] = []
    for entry in ranks:
        rank = _rank_entry(entry)
        if rank is None:
            hint = difflib.get_close_matches(str(entry).strip().upper(), RANK_NAMES, n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(
                f"ranks: {entry!r} is not a card rank; use names {', '.join(RANK_NAMES)} or numbers 1..13.{extra}"
            )
        if rank in out:
            raise ValueError(
                f"ranks lists {RANK_NAMES[rank - 1]!r} twice ({list(ranks)!r}); list each rank once"
            )
        out.append(rank)
    if not out:
        raise ValueError(f"ranks is empty: list at least one rank, e.g. {example}")
    return tuple(sorted(out))


def _rank_entry(entry: object) -> int | None:
    """One entry of ``ranks``: a rank name (``"A"``, ``"10"``, ``"k"``) or a number 1..13, else ``None``."""
    if isinstance(entry, str):
        text = entry.strip().upper()
        if text in RANK_NAMES:
            return RANK_NAMES.index(text) + 1
        return int(text) if text.isdigit() and 1 <= int(text) <= 13 else None
    if isinstance(entry, int) and not isinstance(entry, bool) and 1 <= entry <= 13:
        return entry
    return None


def deck(suits: SuitSet = "any", ranks: Sequence[int] | None = None) -> tuple[Card, ...]:
    """All cards of the chosen suits and ranks (default all 13), in a fixed order (so dealing
    depends only on the RNG): suit by suit, ranks ascending."""
    if suits not in SUIT_SETS:
        raise ValueError(f"suits must be one of {tuple(SUIT_SETS)}, got {suits!r}")
    chosen = ALL_RANKS if ranks is None else tuple(sorted(ranks))
    return tuple(Card(rank, suit) for suit in SUIT_SETS[suits] for rank in chosen)


def deal(
    rng: np.random.Generator, n: int = 4, suits: SuitSet = "any", ranks: Sequence[int] | None = None
) -> tuple[Card, ...]:
    """``n`` distinct cards of :func:`deck` ``(suits, ranks)`` drawn without replacement with ``rng``."""
    cards = deck(suits, ranks)
    if not 1 <= n <= len(cards):
        raise ValueError(
            f"cannot deal {n} distinct cards from a deck of {len(cards)} (suits {suits!r}, ranks "
            f"{[RANK_NAMES[r - 1] for r in sorted({c.rank for c in cards})]}): deal fewer cards, add "
            "ranks or use suits='any'"
        )
    picks = rng.choice(len(cards), size=n, replace=False)
    return tuple(cards[int(i)] for i in picks)


def rank_of_claim(claim: object) -> int | None:
    """Read one entry of the model's ``cards`` list as a rank: ``"Q"``, ``"q♠"``, ``12``, ``"10"``.

    Numbers are returned as given (1..13); callers decide whether a number names a rank or a
    value. Anything else -> ``None``.
    """
    if isinstance(claim, bool):
        return None
    if isinstance(claim, int):
        return claim if 1 <= claim <= 13 else None
    if isinstance(claim, float) and claim.is_integer():
        return rank_of_claim(int(claim))
    if not isinstance(claim, str):
        return None
    text = claim.strip().upper()
    for symbol in SUIT_SYMBOLS.values():
        text = text.replace(symbol, "")
    words = {"ACE": "A", "JACK": "J", "QUEEN": "Q", "KING": "K"}
    text = words.get(text, text)
    if len(text) >= 2 and text[-1] in SUITS and text[:-1] in RANK_NAMES:
        text = text[:-1]
    if text in RANK_NAMES:
        return RANK_NAMES.index(text) + 1
    if text.isdigit() and 1 <= int(text) <= 13:
        return int(text)
    return None


def recognition(claims: Sequence[object] | None, cards: Sequence[Card], face_cards: FaceRule) -> float | None:
    """Fraction of dealt ``cards`` matched by the model's ``claims`` (multiset match), ``None`` if no list.

    First pass matches ranks exactly (``"J"`` or ``11`` for a jack); a second pass lets a
    number equal to the card's value under the rule match (``10`` for a jack when J = 10).
    """
    if claims is None or isinstance(claims, (str, bytes)) or not cards:
        return None
    read = [rank_of_claim(c) for c in claims]
    unmatched = list(cards)
    remaining = [r for r in read if r is not None]
    for card in list(unmatched):
        if card.rank in remaining:
            remaining.remove(card.rank)
            unmatched.remove(card)
    for card in list(unmatched):
        value = card_value(card.rank, face_cards)
        if value in remaining:
            remaining.remove(value)
            unmatched.remove(card)
    return (len(cards) - len(unmatched)) / len(cards)
