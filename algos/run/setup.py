"""Setting a run up: the policy, critic, optimizer and learning-rate schedule a config describes,
the run folder claimed for one run, and the trainable weights saved into and read back from
checkpoints (training resumes with them, evaluation loads a checkpoint's policy with them).

Reading order: ``build_policy`` -> ``build_critic`` -> ``build_optimizer`` -> ``lr_lambda``;
``claim_run_dir`` (refuse, resume or replace an existing run folder); ``trainable_state`` /
``load_trainable_state`` (the one weight loader); ``load_checkpoint_policy`` (any saved policy).
"""

from __future__ import annotations

import fcntl
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from veriloop.agents.atomic import write_text_atomic
from veriloop.agents.loading import LoraSettings, load_policy
from veriloop.agents.model_check import check_unknown_family
from veriloop.agents.policy import Policy, place, resolve_device
from veriloop.agents.precision import apply_precision
from veriloop.algos.learner.critic import ValueModel
from veriloop.algos.run.checkpoint import complete_checkpoints
from veriloop.algos.run.lock import LOCK_FILE, acquire, release
from veriloop.configs.loader import config_to_yaml, dump_config
from veriloop.configs.schema import ConfigError, ExperimentConfig

# ----------------------------------------------------------------------------------------- build


def _modules(names: str | list[str]) -> str | tuple[str, ...]:
    """``policy.target_modules`` as ``LoraSettings`` stores it (a list from YAML becomes a tuple)."""
    return names if isinstance(names, str) else tuple(names)


def build_policy(cfg: ExperimentConfig) -> Policy:
    """The policy as ``cfg.policy`` describes it: LoRA or full, reference only if KL needs it, on
    ``policy.device`` (checked before anything loads)."""
    p = cfg.policy
    try:
        device = resolve_device(p.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if p.model == "tiny":  # a tiny random model with the real tokenizer: for tests and smoke runs
        from veriloop.agents.testing import tiny_policy

        tiny = tiny_policy(
            lora=p.lora, seed=cfg.rollout.seed, keep_reference=cfg.keep_reference and not p.lora
        )
        tiny = apply_precision(place(tiny, device), p.precision)
        check_chat_template(tiny.tokenizer, tiny.processor, cfg.env.system_prompt, cfg.env.assistant_prefix)
        return tiny
    lora = (
        LoraSettings(
            r=p.lora_r, alpha=p.lora_alpha, dropout=p.lora_dropout, target_modules=_modules(p.target_modules)
        )
        if p.lora
        else None
    )
    policy = load_policy(p.model, lora=lora, dtype=p.dtype, keep_reference=cfg.keep_reference and not p.lora)
    policy = apply_precision(
        place(policy, device), p.precision
    )  # bf16: frozen weights bf16, trained ones fp32
    # a family outside the tested matrix: its batched/cached log-probs checked against a plain forward
    # (``train`` checks it before the run folder is made: check_policy_family; not twice)
    if _family_key(cfg) not in _CHECKED and (problem := check_unknown_family(policy)) is not None:
        raise ConfigError(problem)
    check_chat_template(policy.tokenizer, policy.processor, cfg.env.system_prompt, cfg.env.assistant_prefix)
    return policy


#: The (model, LoRA, precision, device) settings whose family check passed in this process.
_CHECKED: set[tuple[Any, ...]] = set()


def _family_key(cfg: ExperimentConfig) -> tuple[Any, ...]:
    p = cfg.policy
    return (p.model, p.lora, p.precision, p.dtype, p.device)


def check_policy_family(cfg: ExperimentConfig) -> None:
    """The start-up log-prob check (``agents.model_check.check_unknown_family``) before the run
    folder exists: a model whose ``config.json`` names a family the architecture matrix covers (or
    a VLM, or a shipped model) is not loaded here; any other is loaded once, checked and dropped,
    and a mismatch raises :class:`ConfigError` (one line) with nothing written."""
    from veriloop.agents.model_check import needs_startup_check

    if cfg.policy.model in ("tiny", "default", "default-vision", "gemma3-270m"):
        return
    if not needs_startup_check(cfg.policy.model) or _family_key(cfg) in _CHECKED:
        return
    with torch.random.fork_rng(devices=[]):  # the run's own build draws the same LoRA init later
        policy = build_policy(cfg)  # raises ConfigError on a mismatch
    del policy
    _CHECKED.add(_family_key(cfg))


def check_chat_template_files(cfg: ExperimentConfig) -> None:
    """Before the run folder is made or the model loads: the chat template of ``policy.model``'s
    tokenizer alone, where that is cheap (``tiny``, or a local text-model folder holding its
    tokenizer); :func:`check_chat_template` checks every other model once it is loaded."""
    model = cfg.policy.model
    if model == "tiny":
        from veriloop.agents.testing import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    else:
        path = Path(model).expanduser()
        if not (path / "tokenizer_config.json").is_file() or any(
            (path / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")
        ):  # a shipped or Hub model (checked once loaded), or a vision model (its processor renders)
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    check_chat_template(tokenizer, None, cfg.env.system_prompt, cfg.env.assistant_prefix)


def check_chat_template(
    tokenizer: Any, processor: Any, system_prompt: str | None, assistant_prefix: str | None = None
) -> None:
    """The chat template renders a prompt (``agents.chat.ChatFormat``: there is one, and it writes the
    user's text and ``system_prompt``), and ``assistant_prefix`` does not end the turn it opens, before
    any step; else a one-line :class:`ConfigError` (a template that drops the task trains for hours on
    prompts without it)."""
    from veriloop.agents.chat import ChatFormat

    try:
        ChatFormat(tokenizer, system_prompt, processor=processor)
    except ValueError as e:
        raise ConfigError(f"policy.model: {e}") from None
    try:
        ChatFormat(tokenizer, system_prompt, processor=processor, assistant_prefix=assistant_prefix)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_critic(cfg: ExperimentConfig, policy: Policy) -> ValueModel | None:
    if not cfg.algo.needs_critic:
        return None
    if cfg.algo.critic == "separate":  # the policy's pretrained weights + a fresh head, trained in fp32
        critic = ValueModel.separate(policy.model)
        return critic.float() if policy.precision == "bf16" else critic  # not the bf16 of a frozen base
    return ValueModel(policy.model)  # value head on the policy's own backbone


def build_optimizer(
    cfg: ExperimentConfig, policy: Policy, critic: ValueModel | None
) -> torch.optim.Optimizer:
    params = {id(p): p for p in policy.trainable_parameters()}
    if critic is not None:  # the shared backbone's parameters are already in; add the head (or model)
        params.update({id(p): p for p in critic.parameters() if p.requires_grad})
    return torch.optim.AdamW(list(params.values()), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def lr_lambda(cfg: ExperimentConfig) -> Any:
    """Linear warm-up, then constant / linear decay / cosine, as a multiplier of ``train.lr``."""
    warm, total, shape = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.schedule

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(total - warm, 1)
        if shape == "linear":
            return max(0.0, 1.0 - progress)
        if shape == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


# ------------------------------------------------------------------------------------- weights


def trainable_state(policy: Policy, critic: ValueModel | None) -> dict[str, torch.Tensor]:
    """Only what training changes (LoRA adapters, or all weights), plus a critic's head/model."""
    return {k: p.detach() for k, p in trainable_parameters(policy, critic).items()}


def trainable_parameters(policy: Policy, critic: ValueModel | None) -> dict[str, torch.nn.Parameter]:
    """The parameters of :func:`trainable_state`, under its keys (a checkpoint's ``model.pt``'s)."""
    params = {f"policy.{n}": p for n, p in policy.model.named_parameters() if p.requires_grad}
    if critic is not None:
        params.update(
            {
                f"critic.{n}": p
                for n, p in critic.named_parameters()
                if p.requires_grad and not n.startswith("backbone.")
            }
        )
        if critic.backbone is not policy.model:
            params.update({f"critic.{n}": p for n, p in critic.backbone.named_parameters()})
    return params


def load_trainable_state(
    policy: Policy,
    critic: ValueModel | None,
    state: dict[str, torch.Tensor],
    *,
    source: str = "checkpoint",
    policy_only: bool = False,
) -> None:
    """Copy :func:`trainable_state`'s output (a checkpoint's ``model/model.pt``) into ``policy`` and
    ``critic``; ``policy_only`` skips the critic's weights (evaluation needs none).

    Raises ``KeyError`` naming a key this model does not have: the state was trained with another
    config (``source`` names where it came from)."""
    targets = dict(policy.model.named_parameters())
    heads = dict(critic.named_parameters()) if critic is not None else {}
    with torch.no_grad():
        for key, value in state.items():
            scope, name = key.split(".", 1)
            if scope != "policy" and policy_only:
                continue
            table = targets if scope == "policy" else heads
            if name not in table:
                raise KeyError(
                    f"{source} holds {key!r}, which this model does not have: it was trained with another "
                    "config (resume or evaluate with the run's own config.yaml)"
                )
            table[name].copy_(value)


# ------------------------------------------------------------------------------------ run folder

#: Settings a resumed run may change from the saved config (how long, how often, how it is measured).
RESUMABLE_CHANGES = ("train.steps", "eval.", "run.checkpoint_every", "run.keep_last", "run.tensorboard",
                     "run.wandb", "run.log_samples", "train.log_every", "rollout.server.", "policy.device",
                     "train.max_uninformative_steps", "train.warn_truncation_above", "train.untrained_after_groups")  # fmt: skip


def claim_run_dir(run_dir: Path, cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    """Make ``run_dir`` this run's own, or stop before anything is written or loaded.

    A new or empty folder is used as is. An existing run is continued only with ``resume`` (and
    a config that matches its ``config.yaml`` but for :data:`RESUMABLE_CHANGES`, and enough
    ``train.steps`` to reach its newest checkpoint), replaced only with ``overwrite``; otherwise
    :class:`ConfigError` says so and nothing in it changes. The caller holds the folder's lock
    (``run_lock``), so leftovers of killed saves found here are stale and are removed.
    """
    _check_contents(run_dir, cfg, resume=resume, overwrite=overwrite)
    claim_folder(run_dir, resume=resume, overwrite=overwrite, what="a run")
    remove_stale_temporaries(run_dir)
    write_text_atomic(run_dir / "config.yaml", config_to_yaml(cfg))


def check_claim(run_dir: Path, cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    """Every refusal :func:`claim_run_dir` can give, without writing anything (not even the lock
    file): called before the lock is taken, so a refused start leaves no folder behind, and again
    under the lock. A folder a live trainer holds is reported as that first."""
    check_not_busy(run_dir)
    _check_contents(run_dir, cfg, resume=resume, overwrite=overwrite)


def _check_contents(run_dir: Path, cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> None:
    existing = check_folder(run_dir, resume=resume, overwrite=overwrite, what="a run")
    if existing and resume:
        _check_resume_config(run_dir, cfg)
        _check_resume_steps(run_dir, cfg)


def check_not_busy(run_dir: Path) -> None:
    """Raise ``RunBusyError`` (naming the holder, as ``lock.acquire`` does) when a live process holds
    ``run_dir``'s lock; creates nothing when the folder or its lock file does not exist."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released when fd closes
    except BlockingIOError:
        release(acquire(run_dir))  # held: acquire raises with the holder's name (released if it just ended)
    finally:
        os.close(fd)


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds anything but the lock file (a run, or a run's leftovers)."""
    return folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir())


def check_folder(folder: Path, *, resume: bool, overwrite: bool, what: str) -> bool:
    """:func:`claim_folder`'s refusals alone (nothing is written); returns whether it holds ``what``."""
    if resume and overwrite:
        raise ConfigError(f"--resume continues {what} and --overwrite deletes it: choose one")
    existing = holds_run(folder)
    if existing and not resume and not overwrite:
        raise ConfigError(
            f"{folder} already holds {what}; nothing was changed. Continue it with --resume, replace it "
            "with --overwrite, or choose another name (run.name=...)"
        )
    return existing


def claim_folder(folder: Path, *, resume: bool, overwrite: bool, what: str) -> bool:
    """The one claim of a run's folder (``veriloop train``'s run folder, ``veriloop sft``'s ``sft/``):
    a new or empty folder is used as is; one that holds ``what`` already is continued only with
    ``resume``, emptied only with ``overwrite`` (the lock, which the caller holds, stays); otherwise
    :class:`ConfigError` says so and nothing changes. Returns whether it held something."""
    existing = check_folder(folder, resume=resume, overwrite=overwrite, what=what)
    if existing and overwrite:
        for child in folder.iterdir():  # all but the lock, which this process holds
            if child.name != LOCK_FILE:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return existing


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the ``.tmp-*`` / ``.old-*`` leftovers of folder and file replacements (``final/``,
    ``config.yaml``...) that a killed process left in ``run_dir`` and ``run_dir/sft``. Call it only
    while holding the run's lock: then no live process is writing them. Returns what was removed."""
    removed = []
    for folder in (run_dir, run_dir / "sft"):
        for p in folder.glob(".*") if folder.is_dir() else []:
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def _check_resume_steps(run_dir: Path, cfg: ExperimentConfig) -> None:
    """A resumed run may train longer, never shorter than its newest checkpoint."""
    done = [int(p.name.split("-")[1]) for p in complete_checkpoints(run_dir)]
    if done and max(done) > cfg.train.steps:
        raise ConfigError(
            f"--resume: {run_dir} already has a checkpoint at step {max(done)}, past train.steps="
            f"{cfg.train.steps}; nothing was changed. Resume with train.steps >= {max(done)} (its final/ "
            "policy is the one to evaluate if the run is finished)"
        )


def _check_resume_config(run_dir: Path, cfg: ExperimentConfig) -> None:
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(yaml.safe_load(saved_file.read_text()) or {})
    now = _flatten(dump_config(cfg))
    # run.out_dir / run.name only say where the folder is: a moved or copied run resumes where it is now
    changed = sorted(
        k
        for k in saved.keys() | now.keys()
        if saved.get(k) != now.get(k)
        and not k.startswith(RESUMABLE_CHANGES)
        and k not in ("run.out_dir", "run.name")
    )
    if changed:
        diff = "; ".join(f"{k}: {_short(saved.get(k))} -> {_short(now.get(k))}" for k in changed[:6])
        raise ConfigError(
            f"--resume: the config differs from the one {run_dir} was trained with ({diff}); resume with "
            f"the saved config (`veriloop train {run_dir / 'config.yaml'} --resume`), or start a new run.name"
        )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def check_device(name: str) -> None:
    """``policy.device`` exists on this machine (a CUDA device on a CPU-only one is refused here,
    before the run folder is claimed)."""
    try:
        resolve_device(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_backend_family(model: str, backend: str) -> None:
    """A vision-language ``model`` is sampled by the HF engine only: ``rollout.backend`` ``vllm`` or
    ``vllm_server`` with one is refused here, before the run folder exists or any model loads (the
    vLLM backends send token ids only, not the images; and vLLM 0.32's CPU build cannot import its
    Qwen-VL models, which need torchvision)."""
    if backend not in ("vllm", "vllm_server"):
        return
    from veriloop.agents.loading import vision_model_type

    if (kind := vision_model_type(model)) is not None:
        raise ConfigError(
            f"rollout.backend={backend}: {model!r} is a vision-language model ({kind}), which veriloop "
            "samples with the HF engine only; set rollout.backend=hf (or auto)"
        )


def check_model(model: str) -> None:
    """``policy.model`` names a loadable model: 'tiny', 'default', 'default-vision', 'gemma3-270m'
    (its PyPI packages installed, or already converted) or a folder with config.json /
    adapter_config.json (nothing is loaded here)."""
    if model in ("tiny", "default", "default-vision"):
        return
    if model == "gemma3-270m":
        from veriloop.agents.models.gemma import missing_reason

        if (why := missing_reason()) is not None:
            raise ConfigError(f"policy.model: {why}")
        return
    from veriloop.agents.loading import _resolve, check_model_files

    try:
        check_model_files(_resolve(model))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"policy.model: {e}") from None


def load_checkpoint_policy(cfg: ExperimentConfig, checkpoint: str) -> Policy:
    """The policy of ``checkpoint``: ``base``/``default`` = ``cfg.policy.model`` (``tiny`` included), a
    folder saved by ``save_policy`` (full weights or a LoRA adapter), or a training checkpoint
    ``run/checkpoints/step-N`` (its ``model/model.pt`` trainable weights on top of ``cfg``'s policy)."""
    from veriloop.agents.loading import load_policy

    if checkpoint in ("base", "default"):
        if cfg.policy.model == "tiny":
            from veriloop.agents.testing import tiny_policy

            return tiny_policy(seed=cfg.rollout.seed)
        return load_policy(cfg.policy.model, dtype=cfg.policy.dtype)
    path = Path(checkpoint)
    state_file = path / "model" / "model.pt"
    if state_file.is_file():
        return _policy_from_training_checkpoint(cfg, state_file)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint {checkpoint!r} is not a folder: pass 'base', a folder written by save_policy (e.g. "
            "runs/<name>/final) or a training checkpoint runs/<name>/checkpoints/step-NNNNNN"
        )
    if cfg.policy.model == "tiny" and (path / "adapter_config.json").is_file():
        return _tiny_with_adapter(cfg, path)  # the tiny test model has no folder to name as a base
    return load_policy(path, dtype=cfg.policy.dtype)


def _tiny_with_adapter(cfg: ExperimentConfig, path: Path) -> Policy:
    from peft import PeftModel

    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(seed=cfg.rollout.seed)
    policy.model = PeftModel.from_pretrained(policy.model, path)
    return policy


def _policy_from_training_checkpoint(cfg: ExperimentConfig, state_file: Path) -> Policy:
    policy = build_policy(cfg)
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    load_trainable_state(policy, None, state, source=str(state_file), policy_only=True)
    return policy
