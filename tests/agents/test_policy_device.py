"""``policy.device``: parsing, the refusal of a CUDA device torch does not have (before any model
loads), and the forward pass's device handling on one device. The GPU side is ``tests/gpu``."""

from __future__ import annotations

import pytest
import torch

from veriloop.agents.forward import on_model_device
from veriloop.agents.policy import resolve_device
from veriloop.configs.loader import load_config
from veriloop.configs.schema import ConfigError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", "mps"])
def test_a_device_that_is_not_auto_cpu_or_cuda_is_refused_at_load(bad: str) -> None:
    with pytest.raises(ConfigError, match="policy.device must be auto, cpu, cuda or cuda:N"):
        load_config("quickstart", [f"policy.device={bad}"])


@no_cuda
def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_with_the_fix() -> None:
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="sees no CUDA device: use policy.device=cpu"):
            resolve_device(name)


@no_cuda
def test_build_policy_refuses_cuda_before_loading_the_model() -> None:
    from veriloop.algos.run.setup import build_policy

    cfg = load_config("quickstart", ["policy.model=/no/such/model", "policy.device=cuda"])
    with pytest.raises(ConfigError, match="policy.device is 'cuda'"):  # not the missing model
        build_policy(cfg)


def test_inputs_already_on_the_models_device_are_passed_through() -> None:
    model = torch.nn.Linear(2, 2)
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    extra = {"pixel_values": torch.zeros(1, 2), "flag": True}
    got_ids, got_mask, got_extra = on_model_device(model, ids, mask, extra)
    assert got_ids is ids and got_mask is mask and got_extra is extra
