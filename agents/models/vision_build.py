"""Build ``"default-vision"`` (see :mod:`veriloop.agents.models.vision` for what it is) and cache it.

    default_vision_model_path()      the cached folder; builds it on first use (~20-30 min, 2 cores)
    build_vision_model(out, ...)     build into ``out`` (any settings; tests use ``TINY_BUILD``)
    python -m veriloop.agents.models.vision_build [--seed N]      build the cache entry now, with progress

The loop is two plain stages (align, then caption), each ``steps`` optimizer steps over fresh
seeded deals. Progress lines go to stderr at most every ``PROGRESS_EVERY_S`` seconds (one line
each, no carriage returns: they read well in a log file). Every ``checkpoint_every_s`` seconds the
trainable weights, the optimizer and the step are saved to ``resume`` (a sibling of the cache
entry); a build started again with the same settings continues from there, and the data of a
step depends only on ``(seed, step)``, so the resumed model is the one an uninterrupted build makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.models.card_reading import heldout_deals, training_deals
from veriloop.agents.models.vision import (
    DEFAULT_BUILD,
    DEFAULT_VISION_NAME,
    REPORT_FILE,
    VISION_MODEL_DIR,
    VisionBuildSettings,
    _pixels,
    align_loss,
    assemble,
    caption_batch,
    caption_loss,
    evaluate,
    image_features,
    make_processor,
    prompt_ids,
    rank_targets,
    token_slots,
    trainable_parts,
    whiten_patch_embedding,
)

#: Step numbers of the deals used for the patch-embedding init and for stage 2 (stage 1 uses 0, 1, ...).
WHITEN_STREAM, CAPTION_STREAM = 2_000_000, 1_000_000
#: Seconds between progress lines.
PROGRESS_EVERY_S = 30.0


def _say(text: str) -> None:
    print(f"[{DEFAULT_VISION_NAME}] {text}", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


class _Stage:
    """Progress of one stage: a line at most every ``PROGRESS_EVERY_S`` s and at the last step."""

    def __init__(self, name: str, total: int, start: int, say: Callable[[str], None]) -> None:
        self.name, self.total, self.start, self.say = name, total, start, say
        self.t0 = self.last = time.monotonic()
        say(f"{name}: steps {start}/{total} done, {total - start} to go")

    def step(self, done: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and done < self.total:
            return
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-9)
        left = f", ~{_clock((self.total - done) / rate)} left" if done < self.total and rate > 0 else ""
        shown = "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        self.say(f"{self.name}: step {done}/{self.total}  {shown}  ({_clock(now - self.t0)}{left})")


def _lr(base: float, step: int, total: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of ``base``."""
    warm = max(1, total // 20)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def _load_resume(resume: Path | None, settings: VisionBuildSettings) -> dict[str, Any] | None:
    if resume is None or not resume.is_file():
        return None
    state = torch.load(resume, weights_only=False)
    return state if state.get("settings") == dataclasses.asdict(settings) else None


def build_vision_model(
    out: Path,
    settings: VisionBuildSettings = DEFAULT_BUILD,
    *,
    text_model: Path | None = None,
    resume: Path | None = None,
    say: Callable[[str], None] = _say,
) -> dict[str, Any]:
    """Build the VLM into the folder ``out`` (``save_pretrained`` layout + ``build_report.json``).

    Args:
        out: Existing empty folder to write into.
        settings: What to build (:class:`VisionBuildSettings`); the seed decides everything else.
        text_model: Folder of a causal LM + tokenizer; default: the default model (SmolLM2-135M-Instruct).
        resume: Checkpoint file to continue from and to save to (``None``: no checkpoints).
        say: Where progress lines go.

    Returns:
        The build report: settings, seconds taken, recognition on held-out black and red deals.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    from veriloop.agents.models.text import default_model_path, normalize_tokenizer

    t_start = time.monotonic()
    source = Path(text_model) if text_model is not None else default_model_path()
    say(f"building from {source} with {settings}")
    tokenizer = normalize_tokenizer(AutoTokenizer.from_pretrained(source))
    processor = make_processor(tokenizer, settings)
    model = assemble(
        LlamaForCausalLM.from_pretrained(source, dtype=torch.float32), processor.tokenizer, settings
    )
    exclude = set(heldout_deals(settings.seed, settings.eval_deals, "black"))
    whiten_patch_embedding(
        model, _pixels(processor, training_deals(settings.seed, WHITEN_STREAM, 256, exclude))
    )
    params = trainable_parts(model)
    state = _load_resume(resume, settings)
    if state is not None:
        model.load_state_dict(state["trainable"], strict=False)
        say(f"resuming from {resume}: stage {state['stage']}, step {state['step']}")
    stages = [
        (
            "align",
            settings.align_steps,
            settings.align_lr,
            lambda s: _align_step(model, processor, settings, exclude, s),
        ),
        (
            "caption",
            settings.caption_steps,
            settings.caption_lr,
            lambda s: _caption_step(model, processor, settings, exclude, s),
        ),
    ]
    for index, (name, steps, lr, run_step) in enumerate(stages):
        if index >= (state["stage"] if state else 0):
            _run_stage(model, params, index, name, steps, lr, run_step, state, settings, resume, say)
    say(f"evaluating on {settings.eval_deals} held-out black-suit and {settings.eval_deals} red-suit deals")
    report = {
        "settings": dataclasses.asdict(settings),
        "text_model": "default" if text_model is None else str(text_model),
        **evaluate(model, processor, settings),
    }
    report["build_seconds"] = round(time.monotonic() - t_start, 1)
    _finish(out, model, processor, report, resume, say)
    return report


def _finish(
    out: Path,
    model: Any,
    processor: Any,
    report: dict[str, Any],
    resume: Path | None,
    say: Callable[[str], None],
) -> None:
    """Save the model, the processor and the report into ``out``; drop the resume checkpoint."""
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (Path(out) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    black, red = report["heldout_black"], report["heldout_red"]
    say(
        f"done in {_clock(report['build_seconds'])}: all four cards read right on {black['all_four']:.1%} "
        f"of held-out black deals ({black['per_card']:.1%} of cards), {red['all_four']:.1%} of red deals "
        f"({red['per_card']:.1%} of cards)"
    )
    if resume is not None and resume.is_file():
        resume.unlink()


def _run_stage(
    model: Any,
    params: list[torch.nn.Parameter],
    index: int,
    name: str,
    steps: int,
    lr: float,
    run_step: Callable[[int], tuple[torch.Tensor, dict[str, float]]],
    state: dict[str, Any] | None,
    settings: VisionBuildSettings,
    resume: Path | None,
    say: Callable[[str], None],
) -> None:
    """One stage: ``steps`` AdamW steps of ``run_step(step) -> (loss, metrics)`` (from the resume
    state's step when it is this stage's), with progress lines and resume checkpoints."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    start = 0
    if state is not None and index == state["stage"] and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    progress = _Stage(f"stage {index + 1}/2 {name}", steps, start, say)
    last_save = time.monotonic()
    model.train()
    for step in range(start, steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(lr, step, steps)
        loss, metrics = run_step(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step(step + 1, metrics)
        if resume is not None and time.monotonic() - last_save >= settings.checkpoint_every_s:
            _save_resume(resume, model, optimizer, settings, index, step + 1)
            last_save = time.monotonic()
    if resume is not None:
        _save_resume(resume, model, None, settings, index + 1, 0)  # next stage: a fresh optimizer
    model.eval()


def _align_step(
    model: Any, processor: Any, settings: VisionBuildSettings, exclude: set, step: int
) -> tuple[torch.Tensor, dict[str, float]]:
    deals = training_deals(settings.seed, step, settings.align_batch, exclude)
    ranks = torch.tensor([[c.rank - 1 for c in d] for d in deals])[:, token_slots(settings)]  # [B, N]
    feats = image_features(model, _pixels(processor, deals))  # [B, N, D]
    loss, acc = align_loss(feats, ranks, rank_targets(model, processor.tokenizer))
    return loss, {"loss": loss.item(), "token_acc": acc.item()}


def _caption_step(
    model: Any, processor: Any, settings: VisionBuildSettings, exclude: set, step: int
) -> tuple[torch.Tensor, dict[str, float]]:
    # a different data stream from stage 1 (step offset), same held-out exclusion
    deals = training_deals(settings.seed, CAPTION_STREAM + step, settings.caption_batch, exclude)
    batch = caption_batch(processor, prompt_ids(processor), deals)
    loss = caption_loss(model, batch["input_ids"], batch["labels"], pixel_values=batch["pixel_values"])
    return loss, {"loss": loss.item()}


def _save_resume(
    path: Path, model: Any, optimizer: Any, settings: VisionBuildSettings, stage: int, step: int
) -> None:
    trainable = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if "language_model" not in k and not k.startswith("lm_head")
    }
    state = {
        "settings": dataclasses.asdict(settings),
        "stage": stage,
        "step": step,
        "trainable": trainable,
        "optimizer": None if optimizer is None else optimizer.state_dict(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def default_vision_model_path(settings: VisionBuildSettings = DEFAULT_BUILD) -> Path:
    """Folder of the cached ``default-vision`` model; built on first use (see the module docstring)."""
    from veriloop.agents.models.text import build_cached, cache_root

    name = VISION_MODEL_DIR if settings.seed == 0 else f"{VISION_MODEL_DIR}-seed{settings.seed}"
    target = cache_root() / "models" / name
    resume = target.parent / f".{target.name}.resume.pt"
    return build_cached(target, lambda tmp: build_vision_model(tmp, settings, resume=resume))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m veriloop.agents.models.vision_build",
        description="Build (or find) the cached default-vision model and print its recognition report.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weight init and all deals")
    args = parser.parse_args(argv)
    path = default_vision_model_path(VisionBuildSettings(seed=args.seed))
    print(path)
    print((path / REPORT_FILE).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
