"""bf16 training, vLLM with CUDA (in-process and as a server) and the quickstart, on a GPU
(``make test-gpu``; every test is skipped without CUDA, see ``conftest.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_step_on_gpu_keeps_trained_weights_fp32() -> None:
    """``policy.precision: bf16`` on CUDA: frozen weights bf16 (norms fp32), LoRA adapters fp32, a finite step."""
    from veriloop.agents.precision import apply_precision
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True, seed=0)
    policy.model.cuda()
    apply_precision(policy, "bf16")
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    frozen = {
        n: p for n, p in policy.model.named_parameters() if not p.requires_grad and p.is_floating_point()
    }
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert frozen and all(
        p.dtype == (torch.float32 if "norm" in n else torch.bfloat16) for n, p in frozen.items()
    )
    before = [p.detach().clone() for p in trained]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    ids = torch.tensor([[1, 5, 9, 14, 2, 7, 7, 3]] * 2, device="cuda")
    loss = policy.model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, trained))


def _vllm_on_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


@pytest.mark.parametrize("module", ["test_vllm_backend.py", "test_vllm_server.py"])
def test_vllm_suites_pass_with_cuda_vllm(module: str) -> None:
    """The vLLM tests (in-process engine; ``veriloop serve-vllm`` server, weight sync by gloo and by
    file, two trainer ranks) against a CUDA build of vLLM."""
    if not _vllm_on_cuda():
        pytest.skip("needs a CUDA build of vLLM in this environment (`pip install vllm`)")
    env = {**os.environ, "VERILOOP_REQUIRE_VLLM": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "agents" / module),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:]


def test_training_loop_puts_the_policy_on_the_gpu() -> None:
    """``policy.device: auto`` (the default) builds the policy on CUDA when torch sees a GPU."""
    from veriloop.algos.run.setup import build_policy
    from veriloop.configs.loader import load_config

    policy = build_policy(load_config("quickstart", ["policy.model=tiny"]))
    assert policy.device.type == "cuda"
    cpu = build_policy(load_config("quickstart", ["policy.model=tiny", "policy.device=cpu"]))
    assert cpu.device.type == "cpu"


#: The quickstart's task with the tiny model and a tiny budget, in fp32 (the quickstart's own precision
#: is bf16); an entropy bonus gives a gradient (the tiny model never earns a reward, so every advantage is 0).
TINY = ["policy.model=tiny", "policy.precision=fp32", "sft.steps=0", "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=16", "train.micro_batch_size=2", "eval.every=0", "eval.at_start=false",
        "eval.num_problems=2", "eval.n_samples=1", "eval.k_list=[1]", "algo.entropy_coef=0.01",
        "run.checkpoint_every=1"]  # fmt: skip

VARIANTS = {
    "lora_grpo": [],
    "ppo_value_head": ["algo.preset=ppo", "algo.entropy_coef=0.01"],
    "full_with_kl": ["policy.lora=false", "algo.kl_coef=0.01", "train.lr=1e-5"],
}


def _step_rows(run: Path) -> list[dict[str, float]]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "grad_norm" in r]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_rl_step_on_the_gpu_matches_the_cpu(tmp_path: Path, variant: str) -> None:
    """The same step (sampling, the forward passes of the update, critic / reference included) on
    ``policy.device=cuda`` and ``cpu`` logs the same numbers up to float rounding, and the GPU run
    saves and resumes (a second step from its checkpoint)."""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    rows = {}
    for device in ("cpu", "cuda"):
        over = [
            *TINY,
            *VARIANTS[variant],
            f"policy.device={device}",
            f"run.out_dir={tmp_path}",
            f"run.name={device}",
        ]
        rows[device] = _step_rows(train(load_config("quickstart", over), quiet=True))
    cpu, gpu = rows["cpu"][0], rows["cuda"][0]
    assert gpu["grad_norm"] > 0
    for key in (
        "entropy",
        "loss/policy",
        "loss/entropy",
        "loss/kl",
        "loss/value",
        "grad_norm",
        "mismatch/k3_kl",
    ):
        assert gpu[key] == pytest.approx(cpu[key], rel=2e-3, abs=1e-5), key
    over = [*TINY, *VARIANTS[variant], "train.steps=2", f"run.out_dir={tmp_path}", "run.name=cuda"]
    resumed = _step_rows(train(load_config("quickstart", over), resume=True, quiet=True))
    assert [r["step"] for r in resumed] == [1, 2] and resumed[0] == rows["cuda"][0]


def test_bf16_quickstart_on_the_gpu(tmp_path: Path) -> None:
    """``policy.precision=bf16`` on the GPU through the training loop: a finite step, adapters fp32."""
    from veriloop.algos.loop.train import train
    from veriloop.configs.loader import load_config

    over = [*TINY, "policy.precision=bf16", f"run.out_dir={tmp_path}", "run.name=bf16"]
    row = _step_rows(train(load_config("quickstart", over), quiet=True))[0]
    assert row["grad_norm"] > 0 and all(v == v for v in row.values() if isinstance(v, float))


def test_quickstart_runs_on_a_gpu_machine(tmp_path: Path) -> None:
    """The quickstart's training (the tiny model, a tiny budget) completes on a CUDA machine and saves final/."""
    cfg = [
        "policy.model=tiny",
        "sft.steps=0",
        "train.steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=16",
        "train.micro_batch_size=2",
        "eval.every=0",
        "eval.at_start=false",
        "eval.num_problems=2",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        f"run.out_dir={tmp_path}",
        "run.name=gpu",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "veriloop.cli", "train", "quickstart", *cfg],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "gpu" / "final" / "veriloop.json").is_file()
