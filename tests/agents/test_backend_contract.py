"""A backend's contract is declared once (``agents/backends/base.py``) and every backend keeps it;
one call (``agents.backends.serving_backend``) builds the engine for the trainer and ``veriloop eval``."""

from __future__ import annotations

import sys
from collections.abc import Hashable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from veriloop.agents import backends as B
from veriloop.agents.backends.base import Backend, ServingBackend, missing_members, protocol_members
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.configs.schema import ExperimentConfig


def test_the_serving_contract_names_every_call_made_on_an_engine():
    assert protocol_members(Backend) == {"generate", "release"}
    assert protocol_members(ServingBackend) == {
        "generate",
        "release",
        "sync",
        "close",
        "pin",
        "adapter_slots",
        "model_name",
        "serves_adapter",
        "keep_adapters",
    }


@pytest.mark.parametrize("name", list(B.BACKENDS))
def test_every_backend_keeps_its_protocol(name):
    """``hf`` samples with the policy itself (``Backend``); every other backend holds its own weights
    and is built by ``serving_backend``, so it keeps the whole ``ServingBackend`` contract."""
    protocol = Backend if name == "hf" else ServingBackend
    assert missing_members(B.backend_class(name), protocol) == []


def test_the_scripted_policy_is_a_backend():
    assert missing_members(ScriptedPolicy, Backend) == []
    assert "sync" in missing_members(ScriptedPolicy, ServingBackend)  # it holds no weights to sync


class Engine:
    """An engine keeping the whole contract; records what it was built with."""

    serves_adapter = False
    keep_adapters = 1
    model_name = "base"
    built: list[dict[str, Any]] = []

    def __init__(self, policy: Any, **kwargs: Any) -> None:
        Engine.built.append(kwargs)

    def generate(self, requests: Any, sampling: Any, generator: Any) -> list[Any]:
        return []

    def release(self, key: Hashable) -> None: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...

    def pin(self, key: Hashable, adapter: str) -> None: ...

    def adapter_slots(self) -> int | None:
        return None


#: The engine without ``pin``.
NoPin = type(
    "NoPin", (), {k: v for k, v in vars(Engine).items() if k not in ("pin", "__dict__", "__weakref__")}
)


class Sampler:
    """Generates but holds no weights: not a serving backend."""

    def __init__(self, policy: Any, **kwargs: Any) -> None:
        raise AssertionError("built although it cannot serve")

    def generate(self, requests: Any, sampling: Any, generator: Any) -> list[Any]:
        return []

    def release(self, key: Hashable) -> None: ...


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = ModuleType("fake_engines")
    module.Engine, module.NoPin, module.Sampler = Engine, NoPin, Sampler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_engines", module)
    monkeypatch.setitem(B.BACKENDS, "vllm", "fake_engines:Engine")
    Engine.built = []
    return module


def _cfg(*pairs: tuple[str, Any]) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.rollout.backend = "vllm"
    cfg.rollout.vllm_kwargs = {"max_model_len": 512}
    for key, value in pairs:
        setattr(cfg.eval if key == "eval.backend" else cfg.rollout, key.split(".")[-1], value)
    return cfg


def test_the_trainer_and_veriloop_eval_build_the_same_engine(engines):
    from veriloop.algos.loop import train as T
    from veriloop.algos.run.distributed import DistContext
    from veriloop.cli.eval import _cli_backend

    policy = SimpleNamespace(is_vision=False, name="tiny")
    cfg = _cfg()
    trained, evaluated = T._rollout_backend(cfg, policy, DistContext()), _cli_backend(cfg, policy)
    assert isinstance(trained, Engine) and isinstance(evaluated, Engine)
    assert isinstance(trained, ServingBackend)  # runtime_checkable: the instance keeps the contract
    assert Engine.built == [{"max_model_len": 512}] * 2
    assert _cli_backend(_cfg(("eval.backend", "hf")), policy) is None  # eval.backend: hf samples with HF
    # vllm_server: training attaches to the servers, ``veriloop eval`` evaluates with the HF engine
    assert B.serving_backend(_cfg(("rollout.backend", "vllm_server")).rollout, policy, servers=False) is None
    assert B.serving_backend(_cfg(("rollout.backend", "hf")).rollout, policy) is None


def _policy(positions: int) -> SimpleNamespace:
    config = SimpleNamespace(max_position_embeddings=positions)
    return SimpleNamespace(is_vision=False, name="tiny", model=SimpleNamespace(config=config))


def test_the_in_process_engine_is_built_for_the_runs_context_not_the_models(engines):
    """vLLM left alone takes the model's own context (Gemma 3 270M: 32768) and warms up on a batch
    that long at every start; no request outgrows ``rollout.max_context``."""
    built = []
    for max_context, positions in [(768, 32768), (64, 32768), (2048, 512)]:
        cfg = _cfg()
        cfg.rollout.vllm_kwargs, cfg.rollout.max_context = {"dtype": "bfloat16"}, max_context
        B.serving_backend(cfg.rollout, _policy(positions))
        built.append(Engine.built[-1]["max_model_len"])
    assert built == [768, B.MIN_MODEL_LEN, 512]  # the run's; a floor for the probe; the model's cap
    B.serving_backend(_cfg().rollout, _policy(32768))
    assert Engine.built[-1] == {"max_model_len": 512}  # rollout.vllm_kwargs decides when it says


@pytest.mark.parametrize(("cls", "lacks"), [("NoPin", "pin"), ("Sampler", "sync")])
def test_a_backend_missing_part_of_the_contract_is_refused_before_it_is_built(
    engines, monkeypatch, cls, lacks
):
    monkeypatch.setitem(B.BACKENDS, "vllm", f"fake_engines:{cls}")
    with pytest.raises(TypeError, match=f"lacks .*{lacks}.* of ServingBackend"):
        B.serving_backend(_cfg().rollout, SimpleNamespace(is_vision=False, name="tiny"))
    assert Engine.built == []
