"""vLLM backend.

The real engine needs CUDA + vllm (``test_vllm_rollout_...`` skips without them). Everywhere else
the backend runs against a small stand-in for the parts of vLLM's documented API it uses
(``LLM(...)``, ``LLM.generate``, ``LLM.collective_rpc``, ``LLM.reset_prefix_cache``,
``SamplingParams``, ``TokensPrompt``, ``LoRARequest``), which records how it is called.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.agents.backends import GenRequest

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class FakeCompletion:  # vllm.outputs.CompletionOutput: the fields the backend reads
    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass
class FakeLLM:
    """Records constructor kwargs, generate calls, weight loads and prefix-cache resets."""

    model: str
    kwargs: dict[str, Any]
    events: list[str] = field(default_factory=list)
    loaded: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)
    calls: list[tuple[list[Any], list[Any], Any]] = field(default_factory=list)
    script: list[FakeCompletion] = field(default_factory=list)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        model = types.SimpleNamespace(load_weights=lambda weights: self.loaded.append(list(weights)))
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
        self.events.append("load_weights")
        return [method(worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        self.calls.append((prompts, sampling_params, lora_request))
        return [types.SimpleNamespace(outputs=[c]) for c in self.script[: len(prompts)]]


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the stand-in as ``vllm`` (and its submodules); yields the list of LLMs built."""
    built: list[FakeLLM] = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda model, **kw: built.append(FakeLLM(model, kw)) or built[-1]  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]  # a TypedDict in vLLM
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda name, int_id, path: types.SimpleNamespace(  # type: ignore[attr-defined]
        lora_name=name, lora_int_id=int_id, lora_path=path
    )
    for name, module in [("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora_request)]:  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return built


def test_default_model_is_resolved_to_the_cached_checkpoint(fake_vllm, monkeypatch, tmp_path):
    from veriloop.agents import default_model
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.testing import tiny_policy

    monkeypatch.setattr(default_model, "default_model_path", lambda: tmp_path / "SmolLM2")
    policy = tiny_policy()
    policy.name, policy.meta = "default", {"base_model": "default"}  # as load_policy("default") sets them
    VLLMBackend(policy)
    assert fake_vllm[-1].model == str(tmp_path / "SmolLM2")  # not "default", which vLLM looks up on the Hub
    VLLMBackend(policy, model_path="/models/x")
    assert fake_vllm[-1].model == "/models/x"


def test_full_sync_loads_every_weight_in_place_then_drops_the_prefix_cache(fake_vllm):
    import os

    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy()
    backend = VLLMBackend(policy, model_path="/base")
    llm = fake_vllm[-1]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and not llm.kwargs["enable_lora"]
    assert llm.events == [
        "load_weights",
        "reset_prefix_cache",
    ]  # at start too: the policy may differ from disk
    with torch.no_grad():
        policy.model.model.norm.weight.add_(1.0)  # an "optimizer step"
    backend.sync()
    assert llm.events[2:] == ["load_weights", "reset_prefix_cache"]  # stale KV blocks must go after a load
    sent = dict(llm.loaded[-1])
    assert sent.keys() == policy.model.state_dict().keys()
    torch.testing.assert_close(sent["model.norm.weight"], policy.model.model.norm.weight)


def test_lora_sync_registers_a_new_adapter_each_time_and_sizes_max_rank(fake_vllm):
    from veriloop.agents.backends.vllm import VLLMBackend, lora_rank_bound
    from veriloop.agents.loading import LoraSettings, build_policy
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True)  # r = 8
    backend = VLLMBackend(policy, model_path="/base")
    llm = fake_vllm[-1]
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 and not llm.loaded
    first = backend._lora_request
    backend.sync()
    second = backend._lora_request
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and first.lora_name != second.lora_name
    assert (Path(second.lora_path) / "adapter_config.json").is_file()
    assert not Path(first.lora_path).exists()  # one adapter folder on disk, not one per step
    wide = build_policy(tiny_policy().model, policy.tokenizer, lora=LoraSettings(r=20))
    assert lora_rank_bound(wide.model) == 32  # vLLM's default max_lora_rank (16) would refuse it


def test_generate_maps_sampling_params_and_results(fake_vllm):
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.agents.testing import tiny_policy

    backend = VLLMBackend(tiny_policy(lora=True), model_path="/base")
    llm = fake_vllm[-1]

    def lp(*pairs):
        return [{tok: types.SimpleNamespace(logprob=v)} for tok, v in pairs]

    llm.script = [
        FakeCompletion([5, 2], lp((5, -0.5), (2, -0.1)), "stop", None),  # end-of-turn token
        FakeCompletion([7, 8, 9], lp((7, -1.0), (8, -2.0), (9, -3.0)), "length"),
        FakeCompletion([4], lp((4, -0.2)), "stop", "###"),  # stop string
    ]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, stop=("###",), seed=3)
    reqs = [GenRequest(i, [1, 2, 3 + i], 3) for i in range(3)]
    out = backend.generate(reqs, sampling, torch.Generator().manual_seed(0))
    assert [r.finish for r in out] == ["eos", "length", "stop"]
    assert out[1].token_ids == [7, 8, 9] and out[1].logprobs == [-1.0, -2.0, -3.0]
    prompts, params, lora = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2, 3 + i]} for i in range(3)]
    assert lora is backend._lora_request
    p = params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.logprobs) == (
        0.7,
        0.9,
        -1,
        3,
        ["###"],
        0,
    )
    assert p.include_stop_str_in_output and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    again = backend.generate(reqs, sampling, torch.Generator().manual_seed(0))
    assert [q.seed for q in llm.calls[-1][1]] == [q.seed for q in params]  # seeds come from the generator
    assert again == out


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
