"""The GPU suite (``make test-gpu``): every test here is marked ``cuda`` and is skipped, with the
reason, on a machine where ``torch.cuda.is_available()`` is False (the CPU wheel, or no GPU)."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False here): run `make test-gpu` on a GPU machine"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tests/gpu, `make test-gpu`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))
