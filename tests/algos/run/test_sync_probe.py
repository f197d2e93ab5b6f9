"""The sampler serves what was just trained: a backend with its own copy of the weights (the HF engine
on a copy of the policy) passes the probe after every sync, and one that skips a sync is caught at
that step, the run stopped naming the backend and the version."""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Hashable, Sequence
from pathlib import Path

import pytest
import torch

import veriloop.algos.loop.train as T
from veriloop.agents.backends.hf import HFBackend
from veriloop.agents.policy import Policy
from veriloop.agents.testing import TINY_MATH_GRPO
from veriloop.algos.run.log import read_metrics
from veriloop.algos.run.sync_probe import TOLERANCE, SamplerMismatchError, check_sampler, probe_gap
from veriloop.configs.loader import load_config
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict

FAST = [
    *TINY_MATH_GRPO,
    "train.micro_batch_size=2",
    "train.lr=1e-2",
    "eval.at_start=false",
    "eval.every=0",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.greedy=false",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
    "train.max_uninformative_steps=0",
]


class CopyBackend:
    """The HF engine on its own copy of the policy; ``sync`` copies the trained tensors into it,
    except at the syncs listed in ``skip`` (1 = the first), which it leaves stale. A serving backend
    of full weights (``ServingBackend`` without adapters), so asynchronous training can drive it."""

    name = "hf-copy"
    model_name = "hf-copy"
    serves_adapter = False
    keep_adapters = 1

    def __init__(self, policy: Policy, skip: Sequence[int] = ()) -> None:
        model = copy.deepcopy(policy.model).eval()
        self.copy = Policy(model=model, tokenizer=policy.tokenizer, is_lora=policy.is_lora, name=policy.name)
        self.engine = HFBackend(self.copy)
        self.trainer, self.skip, self.syncs = policy, set(skip), 0

    def generate(self, requests, sampling, generator):  # type: ignore[no-untyped-def]
        return self.engine.generate(requests, sampling, generator)

    def release(self, key: Hashable) -> None:
        self.engine.release(key)

    def sync(self) -> None:
        self.syncs += 1
        if self.syncs not in self.skip:
            self.copy.model.load_state_dict(self.trainer.model.state_dict())

    def close(self) -> None:
        pass

    def pin(self, key: Hashable, adapter: str) -> None:
        raise AssertionError("full weights: no adapter to pin")

    def adapter_slots(self) -> int | None:
        return None


@pytest.fixture(autouse=True)
def setup(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)

    def check(self, response: str, task) -> Verdict:  # type: ignore[no-untyped-def]
        return Verdict(correct=len(response) % 2 == 0, reason="scripted")  # rewards differ: weights move

    monkeypatch.setattr(MathVerifyEnv, "check", check)


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: Sequence[int], *extra: str) -> Path:
    made: list[CopyBackend] = []
    monkeypatch.setattr(
        T, "_rollout_backend", lambda cfg, policy, dist: made.append(CopyBackend(policy, skip)) or made[-1]
    )
    cfg = load_config(None, [*FAST, f"run.out_dir={tmp_path}", "run.name=r", *extra])
    return T.train(cfg, quiet=True)


def test_a_synced_copy_passes_the_probe_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = read_metrics(_run(tmp_path, monkeypatch, (), "train.steps=3"))
    gaps = [r["sync/probe_gap"] for r in rows]
    assert len(gaps) == 3 and max(gaps) <= TOLERANCE["fp32"]
    assert all(r["time/sync_probe_s"] > 0 for r in rows)


def test_a_skipped_sync_is_caught_at_that_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SamplerMismatchError, match=r"sampler \(hf-copy\).*version 2") as e:
        _run(tmp_path, monkeypatch, (2,), "train.steps=4")
    assert "tolerance 0.001 for fp32" in str(e.value)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1]  # step 2 never logged as if fine


ASYNC = ("train.max_staleness=1", "algo.rollout_is=truncate")


def test_asynchronous_hand_overs_are_probed_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 1: the worker is handed the weights after every step (``AsyncSource.hand_over``) and the
    sampler is probed there as in the synchronous loop."""
    rows = [
        r for r in read_metrics(_run(tmp_path, monkeypatch, (), "train.steps=3", *ASYNC)) if "updates" in r
    ]
    gaps = [r["sync/probe_gap"] for r in rows]
    assert len(gaps) == 3 and max(gaps) <= TOLERANCE["fp32"]


def test_a_skipped_asynchronous_sync_is_caught_at_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 1: a backend that skips the second sync stops the run at that hand-over, before step 2 is
    logged, naming the backend and the version, while the generation worker plays beside it."""
    with pytest.raises(SamplerMismatchError, match=r"sampler \(hf-copy\).*version 2"):
        _run(tmp_path, monkeypatch, (2,), "train.steps=4", *ASYNC)
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1]


def test_probe_gap_of_the_trainer_itself_is_zero(tiny_text_policy) -> None:  # type: ignore[no-untyped-def]
    """The HF engine on the trainer's own model: the KV-cached sampler and the full forward agree."""
    gap, n = probe_gap(tiny_text_policy, HFBackend(tiny_text_policy))
    assert n > 0 and gap < 1e-5
    stale = CopyBackend(tiny_text_policy)
    with torch.no_grad():
        for p in tiny_text_policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(SamplerMismatchError, match="version 7"):
        check_sampler(tiny_text_policy, stale, version=7)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)
@pytest.mark.parametrize("lora_sync", ["merge", "adapter"])
def test_vllm_in_process_passes_after_a_sync_and_is_caught_without_one(lora_sync: str) -> None:
    """vLLM serving merged weights or LoRA adapters (default model, fp32): the probe passes at start
    and after each sync; an adapter moved without a sync is caught."""
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.loading import LoraSettings, load_policy

    policy = load_policy("default", lora=LoraSettings(r=8, alpha=16))
    extra = {"enforce_eager": True} if lora_sync == "adapter" else {}
    backend = VLLMBackend(policy, lora_sync=lora_sync, max_model_len=2048, **extra)
    try:
        backend.sync()
        assert check_sampler(policy, backend, version=0) <= TOLERANCE["fp32"]
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.02 * torch.randn_like(p))
        with pytest.raises(SamplerMismatchError, match="version 1"):
            check_sampler(policy, backend, version=1)  # trained, not synced
        backend.sync()
        assert check_sampler(policy, backend, version=1) <= TOLERANCE["fp32"]
    finally:
        backend.close()


def test_a_bf16_sampler_gets_the_bf16_tolerance_beside_an_fp32_trainer(tiny_text_policy) -> None:  # type: ignore[no-untyped-def]
    """vLLM sampling in bf16 for an fp32 trainer (``rollout.vllm_kwargs.dtype=bfloat16``) differs by a
    few hundredths on the probe without anything being wrong: the tolerance is the coarser side's."""
    backend = CopyBackend(tiny_text_policy)
    with torch.no_grad():  # relative errors a few times bf16's step (2^-8): what its rounding does at scale
        for p in backend.copy.model.parameters():
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    gap, _ = probe_gap(tiny_text_policy, backend)
    assert TOLERANCE["fp32"] < gap < TOLERANCE["bf16"]
    with pytest.raises(SamplerMismatchError, match="tolerance 0.001 for fp32"):
        check_sampler(tiny_text_policy, backend, version=0)
    backend.precision = "bf16"  # type: ignore[attr-defined]
    assert check_sampler(tiny_text_policy, backend, version=0) == pytest.approx(gap)
