"""The default vision-language model, ``"default-vision"``: built here from the default model and cached.

No VLM can be downloaded here, so veriloop makes one. It is a plain transformers **LLaVA**
(``LlavaForConditionalGeneration`` + ``LlavaProcessor``), so everything that works with an HF VLM
works with it (``AutoModelForImageTextToText`` / ``AutoProcessor``, chat template, peft LoRA,
``save_pretrained``)::

    image 128x128 --CLIP-style ViT (2 layers, width 192, patch 16)--> 64 patch features [64, 192]
                  --MLP connector (192 -> 576 -> 576, GELU)-------> 64 image tokens   [64, 576]
    text + image tokens --SmolLM2-135M-Instruct (the default model's weights, unchanged)--> reply

The rendered hand (128x336) is resized to 128x128 by the processor; each card then fills about
two columns of the 8x8 patch grid. The language model is frozen throughout; only the vision
encoder and the connector are trained (seeded init, seeded data), on Points24 card images only
(black suits, J/Q/K as letters, the environment's own renderer), in two stages after a
data-dependent init of the patch embedding (PCA whitening of 256 rendered hands' patches,
:func:`whiten_patch_embedding`; without it a rank's few glyph pixels are lost in the white card
and stage 1 stays at chance for hundreds of steps):

1. **align** (``align_steps``, no language model in the loop, cheap): each image token of patch
   column c is pulled towards the input embedding of the rank of card c (``"10"``: the mean of
   ``"1"`` and ``"0"``), with a cross-entropy over the 13 rank embeddings plus a squared error to
   the right one. Afterwards the image tokens already *are* rank words to the language model.
2. **caption** (``caption_steps``): the LLaVA objective. The chat is ``<image> + CAPTION_PROMPT``
   and the reply the four ranks, ``"A, 8, 5, 10"`` (:mod:`veriloop.agents.models.card_reading`); the loss
   is the language model's cross-entropy on the reply tokens only, back-propagated through the
   frozen language model into the connector and the encoder.

Then it is scored on held-out black-suit deals and on red-suit deals (never seen: visual OOD):
``build_report.json`` in the model folder, with the settings and the build time.

    cache_root()/models/SmolLM2-135M-Instruct-vision-cards/    (~560 MB, float32)

Building takes ~20-30 min on 2 CPU cores; it prints a progress line every ~30 s (log-file
friendly) and saves a resume checkpoint next to the cache entry every few minutes, so a killed
build continues where it stopped. ``python -m veriloop.agents.models.vision`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from veriloop.agents.models.card_reading import (
    CAPTION_PROMPT,
    Deal,
    batches,
    caption,
    heldout_deals,
    recognition_scores,
    render_deals,
)

DEFAULT_VISION_NAME = "default-vision"
VISION_MODEL_DIR = "SmolLM2-135M-Instruct-vision-cards"
IMAGE_TOKEN = "<image>"
REPORT_FILE = "build_report.json"
#: The image token's embedding row is copied from this special token, which the chat model never
#: emits, so the model does not learn to write image placeholders itself.
_IMAGE_ROW_SOURCE = "<empty_output>"
#: Where the hand's four cards lie in the rendered image (``render.py``): x of card 0, pitch, width.
_CARD_X0, _CARD_PITCH, _IMAGE_W = 6, 82, 336


@dataclass(frozen=True)
class VisionBuildSettings:
    """Everything that decides the built model (the same settings and seed give the same model).

    Attributes:
        seed: Seeds the weight init and every training / held-out deal.
        image_size: Side of the square the processor resizes each image to.
        patch_size: ViT patch side; (image_size / patch_size)^2 image tokens per image.
        vision_hidden / vision_layers / vision_heads / vision_mlp: the ViT's width, depth, heads, MLP width.
        align_steps / align_batch / align_lr: stage 1 (token alignment, no language model).
        caption_steps / caption_batch / caption_lr: stage 2 (captioning through the frozen LM).
        eval_deals: held-out deals per evaluation set (black suits, red suits).
        checkpoint_every_s: seconds between resume checkpoints.
    """

    seed: int = 0
    image_size: int = 128
    patch_size: int = 16
    vision_hidden: int = 192
    vision_layers: int = 2
    vision_heads: int = 4
    vision_mlp: int = 768
    align_steps: int = 300
    align_batch: int = 16
    align_lr: float = 1.0e-3
    caption_steps: int = 150
    caption_batch: int = 8
    caption_lr: float = 1.0e-3
    eval_deals: int = 100
    checkpoint_every_s: float = 180.0


#: What ``default-vision`` is built with.
DEFAULT_BUILD = VisionBuildSettings()
#: A build that finishes in seconds (tests): same code, tiny encoder, a few steps.
TINY_BUILD = VisionBuildSettings(
    image_size=32,
    patch_size=16,
    vision_hidden=32,
    vision_layers=1,
    vision_heads=2,
    vision_mlp=64,
    align_steps=2,
    align_batch=4,
    caption_steps=2,
    caption_batch=2,
    eval_deals=4,
    checkpoint_every_s=0.0,
)


# ---------------------------------------------------------------------------------- the architecture
def chat_template() -> str:
    """SmolLM2's ChatML extended to list-of-parts content (each image part -> one ``<image>``)."""
    from veriloop.agents.vision import CHATML_VISION_TEMPLATE

    return CHATML_VISION_TEMPLATE


def make_processor(tokenizer: Any, settings: VisionBuildSettings) -> Any:
    """``LlavaProcessor``: CLIP image processor (square resize, no crop) + the tokenizer with ``<image>``."""
    from transformers import LlavaProcessor

    try:  # the PIL backend; the default one wants torchvision, which is not a dependency
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers
        from transformers import CLIPImageProcessor as ImageProcessor  # type: ignore[assignment]

    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_processor = ImageProcessor(
        size={"height": settings.image_size, "width": settings.image_size},
        do_center_crop=False,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=settings.patch_size,
        vision_feature_select_strategy="default",  # CLIP's CLS token is dropped ...
        num_additional_image_tokens=1,  # ... so (size / patch)^2 tokens per image
        image_token=IMAGE_TOKEN,
        chat_template=chat_template(),
    )


def assemble(text_model: Any, tokenizer: Any, settings: VisionBuildSettings) -> Any:
    """A ``LlavaForConditionalGeneration`` whose language model is ``text_model``'s weights (plus one
    embedding row for ``<image>``) and whose ViT and connector are freshly initialised from the seed."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from veriloop.agents.models.text import end_of_turn_ids

    old_rows = text_model.get_input_embeddings().weight.shape[0]
    text_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    emb = text_model.get_input_embeddings().weight
    with torch.no_grad():
        source = tokenizer.convert_tokens_to_ids(_IMAGE_ROW_SOURCE)
        emb[old_rows:] = emb[source if source is not None and source < old_rows else 0]
    vision = CLIPVisionConfig(
        hidden_size=settings.vision_hidden,
        intermediate_size=settings.vision_mlp,
        num_hidden_layers=settings.vision_layers,
        num_attention_heads=settings.vision_heads,
        image_size=settings.image_size,
        patch_size=settings.patch_size,
        projection_dim=settings.vision_hidden,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_model.config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=text_model.config.tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = LlavaForConditionalGeneration(config)
    missing, unexpected = model.model.language_model.load_state_dict(
        text_model.model.state_dict(), strict=True
    )
    assert not missing and not unexpected
    if not text_model.config.tie_word_embeddings:
        model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    eos = end_of_turn_ids(tokenizer)
    text_config: Any = model.config.text_config  # a PreTrainedConfig once the model is built
    text_config.eos_token_id = eos[0]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def trainable_parts(model: Any) -> list[torch.nn.Parameter]:
    """The vision encoder's and the connector's parameters (the language model stays frozen)."""
    model.requires_grad_(False)
    parts = [model.model.vision_tower, model.model.multi_modal_projector]
    for part in parts:
        part.requires_grad_(True)
    return [p for part in parts for p in part.parameters()]


@torch.no_grad()
def whiten_patch_embedding(model: Any, pixel_values: torch.Tensor) -> None:
    """Data-dependent init of the ViT's patch embedding: PCA whitening of the card images' patches.

    A rank shows only in a few glyph pixels of a mostly white card, so with a random patch embedding
    the differences that matter are a small part of each patch vector and learning is slow. Here
    the embedding's rows become the top principal directions of the patches (over every position
    of ``pixel_values`` [B, C, H, W]), each scaled to unit variance, and each position's embedding
    subtracts that position's mean patch, so every token starts centred and whitened. Only the
    init changes: the weights stay ordinary, trainable ``CLIPVisionEmbeddings`` parameters.
    """
    emb = model.model.vision_tower.embeddings
    conv = emb.patch_embedding  # weight [D, C, P, P], no bias
    d, p = conv.out_channels, conv.kernel_size[0]
    patches = pixel_values.unfold(2, p, p).unfold(3, p, p)  # [B, C, h, w, P, P]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(pixel_values.shape[0], -1, conv.in_channels * p * p)
    mean = patches.mean(0)  # [N, C*P*P] each position's mean patch
    centred = (patches - mean).reshape(-1, patches.shape[-1]).double()
    eigval, eigvec = torch.linalg.eigh(centred.T @ centred / len(centred))  # ascending
    top = eigvec[:, -d:].flip(-1).T * (eigval[-d:].flip(-1).clamp_min(1e-6) ** -0.5)[:, None]  # [D, C*P*P]
    conv.weight.copy_(top.float().reshape(conv.weight.shape))
    pos = emb.position_embedding.weight  # [1 + N, D]: CLS, then the patches in row-major order
    pos[1:] = -mean @ top.float().T


def image_features(model: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    """[B, N, D_text] image tokens exactly as the language model receives them."""
    out = model.model.get_image_features(pixel_values=pixel_values)
    return torch.stack(list(out.pooler_output))


def token_slots(settings: VisionBuildSettings) -> torch.Tensor:
    """[N] which card (0..3) each image token's patch column lies over (row-major patch order)."""
    side = settings.image_size // settings.patch_size
    centre_x = (torch.arange(side) + 0.5) * settings.patch_size * _IMAGE_W / settings.image_size
    column_slot = ((centre_x - _CARD_X0) // _CARD_PITCH).clamp(0, 3).long()  # [side]
    return column_slot.repeat(side)  # [side * side]


def rank_targets(model: Any, tokenizer: Any) -> torch.Tensor:
    """[13, D_text] input embedding of each rank name ``A..K`` (mean over its tokens, e.g. ``1``, ``0``)."""
    from veriloop.envs.points24.cards import RANK_NAMES

    emb = model.get_input_embeddings().weight.detach()
    rows = [emb[tokenizer(name, add_special_tokens=False).input_ids].mean(0) for name in RANK_NAMES]
    return torch.stack(rows)


# ---------------------------------------------------------------------------------- the two objectives
def align_loss(
    features: torch.Tensor, ranks: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 loss: each image token should be the embedding of its card's rank.

    Args:
        features: [B, N, D] image tokens.
        ranks: [B, N] rank index (0 = ace .. 12 = king) of the card under each token.
        targets: [13, D] rank embeddings (:func:`rank_targets`).

    Returns:
        (loss, accuracy): the cross-entropy of the logits ``-||f - e_r||^2`` over the 13 rank
        embeddings ``e_r`` (a nearest-prototype classifier whose prototypes are the words
        themselves, so minimising it moves each token onto its rank's embedding), and the share
        of tokens whose nearest rank embedding is the right one.
    """
    b, n, d = features.shape
    if ranks.shape != (b, n) or targets.shape[1] != d:
        raise ValueError(
            f"align_loss: features {tuple(features.shape)}, ranks {tuple(ranks.shape)}, "
            f"targets {tuple(targets.shape)} do not fit"
        )
    dist = torch.cdist(features.reshape(b * n, d), targets).pow(2)  # [B*N, 13]
    loss = torch.nn.functional.cross_entropy(-dist, ranks.reshape(-1))
    return loss, (dist.detach().argmin(-1) == ranks.reshape(-1)).float().mean()


def caption_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor, **vision: Any) -> torch.Tensor:
    """Stage-2 loss: mean cross-entropy of the reply tokens (``labels != -100``), [B, T] inputs.

    The output head runs only on the positions that predict a reply token (a few per row), not on
    the whole sequence.
    """
    hidden = model.model(input_ids=input_ids, attention_mask=(labels != -200).long(), **vision)
    h = hidden.last_hidden_state[:, :-1]  # [B, T-1, D] position t predicts token t+1
    target = labels[:, 1:]  # [B, T-1]
    keep = target >= 0  # -100 prompt, -200 padding
    return torch.nn.functional.cross_entropy(model.lm_head(h[keep]), target[keep])


# ---------------------------------------------------------------------------------- data
def _pixels(processor: Any, deals: list[Deal]) -> torch.Tensor:
    return processor.image_processor(images=render_deals(deals), return_tensors="pt")["pixel_values"]


def prompt_ids(processor: Any) -> torch.Tensor:
    """[T_p] the caption chat up to the assistant header, image tokens expanded."""
    from veriloop.agents.vision import encode_vision_messages

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}]}]
    image = render_deals(heldout_deals(0, 1))
    return encode_vision_messages(processor, messages, image)["input_ids"][0]


def caption_batch(processor: Any, prompt: torch.Tensor, deals: list[Deal]) -> dict[str, torch.Tensor]:
    """Inputs [B, T] (prompt + reply + ``<|im_end|>``, right-padded), labels on the reply only."""
    tok = processor.tokenizer
    replies = [tok(caption(d) + "<|im_end|>", add_special_tokens=False).input_ids for d in deals]
    width = len(prompt) + max(map(len, replies))
    ids = torch.full((len(deals), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(deals), width), -200, dtype=torch.long)  # -200: padding, -100: prompt
    for i, reply in enumerate(replies):
        ids[i, : len(prompt)] = prompt
        ids[i, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
        labels[i, : len(prompt)] = -100
        labels[i, len(prompt) : len(prompt) + len(reply)] = torch.tensor(reply)
    return {"input_ids": ids, "labels": labels, "pixel_values": _pixels(processor, deals)}


@torch.no_grad()
def read_cards(model: Any, processor: Any, deals: list[Deal], *, batch_size: int = 25) -> list[str]:
    """The model's greedy captions of ``deals`` (one string each)."""
    prompt = prompt_ids(processor)
    out: list[str] = []
    for chunk in batches(deals, batch_size):
        ids = prompt.repeat(len(chunk), 1)  # [B, T_p] every prompt is the same tokens
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=_pixels(processor, list(chunk)),
            max_new_tokens=16,
            do_sample=False,
        )
        out += processor.tokenizer.batch_decode(gen[:, ids.shape[1] :], skip_special_tokens=True)
    return out


def evaluate(model: Any, processor: Any, settings: VisionBuildSettings) -> dict[str, Any]:
    """Recognition on held-out black-suit deals and on red-suit deals (visual OOD)."""
    report = {}
    for suits in ("black", "red"):
        deals = heldout_deals(settings.seed, settings.eval_deals, suits)
        captions = read_cards(model, processor, deals)
        report[f"heldout_{suits}"] = {**recognition_scores(captions, deals), "examples": captions[:3]}
    return report
