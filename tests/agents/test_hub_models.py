"""Hub model ids, resolved the way transformers resolves them: a cache in the Hub layout (what an
online download leaves), read with the network off, a revision honoured, and a missing model refused
with what was tried and how to fix it, before any run folder is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from veriloop.agents.loading import save_policy, split_revision
from veriloop.agents.testing import tiny_policy

MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``models--someone--tiny-model`` with two commits: ``main`` (seed 0) and tag ``v2`` (seed 1)."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--someone--tiny-model"
    for seed, sha in ((0, MAIN), (1, V2)):
        save_policy(tiny_policy(lora=False, seed=seed), repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    # a LoRA adapter repository on top of it (adapter_config.json names the base by Hub id)
    adapter = root / "models--someone--tiny-adapter"
    policy = tiny_policy(lora=True)
    policy.meta["base_model"] = "someone/tiny-model"
    save_policy(policy, adapter / "snapshots" / MAIN)
    (adapter / "refs").mkdir()
    (adapter / "refs" / "main").write_text(MAIN)
    return root


def offline(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


LOAD = """
import torch
from veriloop.agents.loading import load_policy
main = load_policy("someone/tiny-model")
tag = load_policy("someone/tiny-model@v2")
pinned = load_policy("someone/tiny-model", revision="{v2}")
first = lambda p: next(p.model.parameters())
assert main.name == "someone/tiny-model" and tag.name == "someone/tiny-model@v2", (main.name, tag.name)
assert not torch.equal(first(main), first(tag)), "the revision was ignored"
assert torch.equal(first(tag), first(pinned))
adapter = load_policy("someone/tiny-adapter")
assert adapter.is_lora and adapter.meta["base_model"] == "someone/tiny-model", adapter.meta
try:
    load_policy("someone/missing")
except FileNotFoundError as e:
    text = str(e)
    assert "someone/missing" in text and "HF_HUB_OFFLINE=1" in text and "hf download" in text, text
else:
    raise SystemExit("a missing model loaded")
print("ok")
"""


def test_hub_id_loads_from_a_local_cache_offline_with_its_revision(hub_cache: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", LOAD.format(v2=V2)],
        env=offline(hub_cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_missing_model_exits_2_before_anything_is_written(hub_cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "veriloop.cli",
            "train",
            "quickstart",
            "policy.model=someone/missing",
            f"run.out_dir={out}",
        ],
        env=offline(hub_cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "someone/missing" in r.stderr and "Tried:" in r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_cli_trains_from_a_hub_id_offline(hub_cache: Path, tmp_path: Path) -> None:
    tiny = [
        "policy.lora=false",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_context=256",
        "train.steps=1",
        "train.micro_batch_size=2",
        "eval.num_problems=1",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        "eval.every=0",
        "eval.greedy=false",
        "sft.steps=0",
        "run.tensorboard=false",
        "run.checkpoint_every=0",
    ]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "veriloop.cli",
            "train",
            "quickstart",
            "policy.model=someone/tiny-model@v2",
            *tiny,
            f"run.out_dir={tmp_path}",
            "run.name=hub",
        ],
        env=offline(hub_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "hub" / "final" / "config.json").is_file()


def test_split_revision() -> None:
    assert split_revision("Qwen/Qwen2.5-0.5B-Instruct@v1.0") == ("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")
    assert split_revision("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)


def test_a_saved_adapters_base_is_read_from_its_veriloop_json_without_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's saved adapter names its base twice: ``veriloop.json`` ("default", shipped) and
    ``adapter_config.json`` (the portable Hub id). Asking whether it is a vision model must read the
    first: the Hub id made an offline ``veriloop eval`` retry the network for ~45 s."""
    import json

    import transformers.utils

    from veriloop.agents import loading

    (tmp_path / "veriloop.json").write_text(json.dumps({"kind": "lora-adapter", "base_model": "default"}))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    )

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"asked the Hub for {args}")

    monkeypatch.setattr(transformers.utils, "cached_file", no_network)
    assert loading.vision_model_type(str(tmp_path)) is None
    (tmp_path / "veriloop.json").write_text(
        json.dumps({"kind": "lora-adapter", "base_model": "default-vision"})
    )
    assert loading.vision_model_type(str(tmp_path)) == "llava"
