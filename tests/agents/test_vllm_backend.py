"""vLLM backend: runs only with CUDA + vllm; on CPU machines only the install hint is checked."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed; this test checks the error when it is missing")
def test_missing_vllm_names_the_extra_to_install():
    from veriloop.agents.backends import make_backend

    with pytest.raises(ImportError, match=r"pip install veriloop\[vllm\]"):
        make_backend("vllm", policy=None)
    with pytest.raises(ValueError, match="did you mean 'vllm'"):
        make_backend("vlm", policy=None)


@pytest.mark.gpu
def test_vllm_rollout_returns_tokens_and_logprobs(tmp_path):
    pytest.importorskip("vllm", reason="needs `pip install veriloop[vllm]`")
    if not torch.cuda.is_available():
        pytest.skip("the vLLM backend needs a CUDA GPU")
    import veriloop.envs  # noqa: F401
    from veriloop.agents import load_policy
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.default_model import default_model_path
    from veriloop.agents.engine import grouped_specs, rollout
    from veriloop.agents.sampling_params import SamplingParams

    policy = load_policy("default")
    backend = VLLMBackend(policy, model_path=str(default_model_path()), gpu_memory_utilization=0.3)
    specs = grouped_specs("veriloop/Points24-text-v0", {"max_attempts": 2}, [0, 1], 2)
    trajs = rollout(policy, specs, sampling=SamplingParams(max_new_tokens=32, seed=0), backend=backend)
    for tr in trajs:
        assert tr.num_generated_tokens > 0
        assert all(lp <= 0 for lp, m in zip(tr.logprobs, tr.loss_mask) if m)
