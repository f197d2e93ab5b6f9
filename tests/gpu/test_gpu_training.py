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
    """``policy.precision: bf16`` on CUDA: frozen weights bf16, LoRA adapters fp32, a finite step."""
    from veriloop.agents.precision import apply_precision
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True, seed=0)
    policy.model.cuda()
    apply_precision(policy, "bf16")
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    frozen = [p for p in policy.model.parameters() if not p.requires_grad and p.is_floating_point()]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
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
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "agents" / module)], capture_output=True, text=True,
                          timeout=3600, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]


@pytest.mark.xfail(
    strict=True, reason="the training loop has no device setting yet: it loads the policy on CPU"
)
def test_training_loop_puts_the_policy_on_the_gpu() -> None:
    """Fails (xfail) until the loop places the policy on CUDA; then this test passes and must be un-marked."""
    from veriloop.algos.run.setup import build_policy
    from veriloop.configs.loader import load_config

    policy = build_policy(load_config("quickstart", ["policy.model=tiny"]))
    assert policy.device.type == "cuda"


def test_quickstart_runs_on_a_gpu_machine(tmp_path: Path) -> None:
    """The quickstart's training (the tiny model, a tiny budget) completes on a CUDA machine and saves final/."""
    cfg = ["policy.model=tiny", "sft.steps=0", "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=16", "train.micro_batch_size=2", "eval.every=0", "eval.at_start=false", "eval.num_problems=2",
           "eval.n_samples=1", "eval.k_list=[1]", f"run.out_dir={tmp_path}", "run.name=gpu"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "veriloop.cli", "train", "quickstart", *cfg],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "gpu" / "final" / "veriloop.json").is_file()
