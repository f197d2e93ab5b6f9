"""Draw Points24 hands as one small RGB image with Pillow (imported here only).

Layout: ``n`` white card faces side by side on a green table, ``IMAGE_SHAPE = (128, 336, 3)``
whatever ``n`` (1..4): four cards fill the width, fewer are centred, so every variant of the game
(``num_cards``) has the same observation space. Each face shows its rank name top-left and bottom-right (Pillow's default
font) and its suit as a drawn shape (polygons and circles, so no font needs the ♠♣♥♦ glyphs)
in red or black: a small one under each corner rank and a large one in the centre. The
drawing depends only on the cards, so the same deal always gives the same pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from veriloop.envs.points24.cards import Card

CARD_W, CARD_H, GAP = 78, 120, 4
IMAGE_SHAPE = (CARD_H + 2 * GAP, 4 * CARD_W + 5 * GAP + 4, 3)  # (128, 336, 3): [H, W, RGB]
TABLE = (24, 110, 60)
RED, BLACK = (200, 20, 30), (15, 15, 15)


def _pil() -> tuple[Any, Any, Any]:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:  # pragma: no cover - pillow is a core dependency
        raise ImportError("Points24 vision needs Pillow: pip install pillow") from exc
    return Image, ImageDraw, ImageFont


@lru_cache(maxsize=4)
def _font(size: int) -> Any:
    _, _, image_font = _pil()
    try:
        return image_font.load_default(size=size)
    except TypeError:  # Pillow < 10.1: bitmap default font, fixed size
        return image_font.load_default()


def _suit_shape(draw: Any, suit: str, cx: float, cy: float, s: float, color: tuple[int, int, int]) -> None:
    """Draw suit ``suit`` centred at (cx, cy) with half-size ``s`` pixels."""
    if suit == "D":
        draw.polygon([(cx, cy - s), (cx + 0.7 * s, cy), (cx, cy + s), (cx - 0.7 * s, cy)], fill=color)
        return
    r = 0.5 * s
    if suit in ("H", "S"):
        flip = -1 if suit == "S" else 1  # a spade is an upside-down heart plus a stem
        for dx in (-r, r):
            draw.ellipse(
                [cx + dx - r, cy - flip * 0.4 * s - r, cx + dx + r, cy - flip * 0.4 * s + r], fill=color
            )
        draw.polygon(
            [(cx - 2 * r, cy - flip * 0.3 * s), (cx + 2 * r, cy - flip * 0.3 * s), (cx, cy + flip * s)],
            fill=color,
        )
    else:  # clubs: three circles
        for dx, dy in ((0, -0.45 * s), (-0.5 * s, 0.15 * s), (0.5 * s, 0.15 * s)):
            draw.ellipse(
                [cx + dx - 0.42 * s, cy + dy - 0.42 * s, cx + dx + 0.42 * s, cy + dy + 0.42 * s], fill=color
            )
    if suit in ("S", "C"):
        draw.polygon([(cx, cy + 0.2 * s), (cx - 0.35 * s, cy + s), (cx + 0.35 * s, cy + s)], fill=color)


def _draw_card(draw: Any, card: Card, x0: int, y0: int) -> None:
    color = RED if card.is_red else BLACK
    draw.rounded_rectangle(
        [x0, y0, x0 + CARD_W - 1, y0 + CARD_H - 1],
        radius=6,
        fill=(255, 255, 255),
        outline=(90, 90, 90),
        width=1,
    )
    font = _font(18)
    draw.text((x0 + 5, y0 + 3), card.name, fill=color, font=font)
    _suit_shape(draw, card.suit, x0 + 12, y0 + 32, 6, color)
    right = draw.textbbox((0, 0), card.name, font=font)[2]
    draw.text((x0 + CARD_W - 6 - right, y0 + CARD_H - 24), card.name, fill=color, font=font)
    _suit_shape(draw, card.suit, x0 + CARD_W / 2, y0 + CARD_H / 2 + 4, 17, color)


def render_cards(cards: Sequence[Card]) -> np.ndarray:
    """RGB image of one to four cards (fewer are centred); a new ``uint8`` array of shape ``IMAGE_SHAPE``."""
    if not 1 <= len(cards) <= 4:
        raise ValueError(
            f"render_cards draws 1 to 4 cards (the image is four cards wide), got {len(cards)}: "
            "use num_cards <= 4 with vision=True"
        )
    left = GAP + 2 + (4 - len(cards)) * (CARD_W + GAP) // 2  # centre a short hand
    image_mod, draw_mod, _ = _pil()
    height, width, _ = IMAGE_SHAPE
    image = image_mod.new("RGB", (width, height), TABLE)
    draw = draw_mod.Draw(image)
    for i, card in enumerate(cards):
        _draw_card(draw, card, left + i * (CARD_W + GAP), GAP)
    return np.asarray(image, dtype=np.uint8).copy()  # [H, W, 3]
