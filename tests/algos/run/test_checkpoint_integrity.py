"""Checkpoints carry a SHA-256 per file; a damaged newest checkpoint is refused and resume falls
back to the previous intact one with a one-line message (no traceback, no silent wrong weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from veriloop.algos.run.checkpoint import (
    MARKER,
    CheckpointError,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
    sha256_file,
    verify_checkpoint,
)


def _save(run: Path, step: int, value: float) -> Path:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(run, step, model=model, optimizer=opt, trainer_state={"step": step}, keep_last=3)


def _flip_byte(path: Path, offset: int = -20) -> None:
    """Change one byte in place: the size stays the same."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_records_a_checksum_per_file(tmp_path: Path) -> None:
    folder = _save(tmp_path, 1, 0.5)
    files = json.loads((folder / MARKER).read_text())["files"]
    assert set(files) >= {"model/model.pt", "optimizer.pt", "rng.pt", "trainer_state.json"}
    for rel, entry in files.items():
        assert entry == {"size": (folder / rel).stat().st_size, "sha256": sha256_file(folder / rel)}
    verify_checkpoint(folder)  # intact: no error


@pytest.mark.parametrize("damaged", ["model/model.pt", "optimizer.pt"])
def test_same_size_byte_flip_is_refused(tmp_path: Path, damaged: str) -> None:
    folder = _save(tmp_path, 1, 0.5)
    _flip_byte(folder / damaged)
    with pytest.raises(CheckpointError, match=f"{damaged} is damaged"):
        load_checkpoint(folder)


@pytest.mark.parametrize("damaged", ["model/model.pt", "optimizer.pt"])
def test_resume_falls_back_to_the_previous_good_checkpoint(tmp_path: Path, damaged: str) -> None:
    _save(tmp_path, 1, 0.25)
    newest = _save(tmp_path, 2, 0.75)
    _flip_byte(newest / damaged)
    messages: list[str] = []
    applied: list[float] = []
    found = resume_latest(
        tmp_path, lambda c: applied.append(float(c["model_state"]["weight"][0, 0])), warn=messages.append
    )
    assert found is not None and found[0].name == "step-000001" and found[1]["step"] == 1
    assert applied == [0.25]  # the damaged checkpoint never reached the model
    assert len(messages) == 1 and "step-000002" in messages[0] and "previous" in messages[0]
    assert "Traceback" not in messages[0]


def test_a_checkpoint_that_does_not_fit_falls_back_too(tmp_path: Path) -> None:
    """A newest checkpoint that reads but fails to apply (e.g. unknown keys) is skipped as well."""
    _save(tmp_path, 1, 0.25)
    _save(tmp_path, 2, 0.75)

    def apply(c: dict) -> None:
        if c["step"] == 2:
            raise KeyError("checkpoint holds 'policy.x', which this model does not have")

    messages: list[str] = []
    found = resume_latest(tmp_path, apply, warn=messages.append)
    assert found is not None and found[0].name == "step-000001"
    assert "policy.x" in messages[0]


def test_every_checkpoint_damaged_is_one_clear_error(tmp_path: Path) -> None:
    for step in (1, 2):
        _flip_byte(_save(tmp_path, step, 0.5) / "model" / "model.pt")
    with pytest.raises(
        CheckpointError, match=r"no checkpoint of .* could be resumed.*step-000002.*step-000001"
    ):
        resume_latest(tmp_path, lambda c: None, warn=lambda m: None)


def _empty_manifest(folder: Path) -> None:
    (folder / MARKER).write_text(json.dumps({"step": 2, "files": {}}))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


#: Damage short of a flipped byte, and the words the one-line report gives for it.
DAMAGE = {
    "empty-manifest": (_empty_manifest, "does not list the model, rng.pt and trainer_state.json"),
    "unreadable-manifest": (lambda f: (f / MARKER).write_bytes(b"\x00{not json"), "manifest cannot be read"),
    "truncated-file": (lambda f: _truncate(f / "optimizer.pt"), "optimizer.pt is truncated or changed"),
    "missing-marker": (lambda f: (f / MARKER).unlink(), "COMPLETE marker is missing"),
    "missing-file": (lambda f: (f / "rng.pt").unlink(), "rng.pt is missing"),
    "manifest-outside": (
        lambda f: (f / MARKER).write_text(
            json.dumps({"step": 2, "files": {"model/../../../x": 1, "rng.pt": 1, "trainer_state.json": 1}})
        ),
        "outside the checkpoint",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_damage_is_reported_in_one_line_and_the_previous_checkpoint_used(
    tmp_path: Path, damage: str
) -> None:
    """A newest checkpoint damaged in any way (not only a flipped byte) is named with the reason in
    one line before resume falls back; none is skipped in silence or accepted unverified."""
    _save(tmp_path, 1, 0.25)
    newest = _save(tmp_path, 2, 0.75)
    harm, words = DAMAGE[damage]
    harm(newest)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        verify_checkpoint(newest)
    messages: list[str] = []
    applied: list[float] = []
    found = resume_latest(
        tmp_path, lambda c: applied.append(float(c["model_state"]["weight"][0, 0])), warn=messages.append
    )
    assert found is not None and found[0].name == "step-000001" and applied == [0.25]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert "step-000002 cannot be resumed" in messages[0] and words in messages[0], messages[0]
    assert "trying the previous checkpoint" in messages[0]


def test_a_run_whose_only_checkpoints_lack_markers_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    for step in (1, 2):
        (_save(tmp_path, step, 0.5) / MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* could be resumed.*marker is missing"):
        resume_latest(tmp_path, lambda c: None, warn=lambda m: None)


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert resume_latest(tmp_path, lambda c: None, warn=lambda m: None) is None


def test_checkpoints_without_checksums_still_load(tmp_path: Path) -> None:
    """A checkpoint saved before checksums (sizes only in its manifest) is still accepted."""
    folder = _save(tmp_path, 1, 0.5)
    manifest = json.loads((folder / MARKER).read_text())
    manifest["files"] = {rel: e["size"] for rel, e in manifest["files"].items()}
    (folder / MARKER).write_text(json.dumps(manifest))
    assert load_checkpoint(folder)["step"] == 1


TINY = [
    "policy.model=tiny",
    "policy.lora=false",
    "env.kwargs={level: 1}",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.steps=2",
    "train.micro_batch_size=2",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "eval.every=0",
    "eval.at_start=false",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
    "run.keep_last=2",
    "sft.steps=0",
]


def test_train_resume_skips_a_flipped_newest_checkpoint(tmp_path: Path, capsys) -> None:
    """The repro end to end: a same-size byte flip in the newest checkpoint's model.pt. Resume says
    so in one line and continues from the previous checkpoint (before: silently other weights)."""
    from veriloop.algos.loop.train import train
    from veriloop.algos.run.log import read_metrics
    from veriloop.configs.loader import load_config

    run = train(load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r"]), quiet=True)
    _flip_byte(run / "checkpoints" / "step-000002" / "model" / "model.pt")
    capsys.readouterr()
    longer = load_config("quickstart", [*TINY, f"run.out_dir={tmp_path}", "run.name=r", "train.steps=3"])
    train(longer, resume=True)
    out = capsys.readouterr()
    assert "step-000002 cannot be resumed" in out.err and "model/model.pt is damaged" in out.err
    assert "Traceback" not in out.err
    assert "resumed from" in out.out and "step-000001 at step 1" in out.out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # steps 2 and 3 trained again / anew
    verify_checkpoint(run / "checkpoints" / "step-000002")  # re-saved whole


def test_sft_resume_skips_a_damaged_newest_checkpoint(tmp_path: Path, capsys) -> None:
    """The SFT warm-up resumes the same way: past a damaged newest checkpoint, with a message."""
    from veriloop.agents.testing import tiny_policy
    from veriloop.algos.sft.data import SFTExample
    from veriloop.algos.sft.train import TRAINABLE_FILE, train_sft

    examples = [
        SFTExample(
            ({"role": "user", "content": f"Add {i} and 3."}, {"role": "assistant", "content": f"{i + 3}"}),
            (True,),
            {"seed": i},
        )
        for i in range(6)
    ]
    kw = {
        "lr": 1e-2,
        "batch_size": 2,
        "log_every": 1,
        "tensorboard": False,
        "checkpoint_every": 1,
        "keep_last": 3,
    }
    train_sft(tiny_policy(lora=True, seed=2), examples, steps=2, run_dir=tmp_path, **kw)
    _flip_byte(tmp_path / "checkpoints" / "step-000002" / "model" / TRAINABLE_FILE)
    capsys.readouterr()
    out = train_sft(tiny_policy(lora=True, seed=2), examples, steps=3, run_dir=tmp_path, **kw)
    err = capsys.readouterr().err
    assert out["start_step"] == 1 and "step-000002 cannot be resumed" in err and "is damaged" in err
