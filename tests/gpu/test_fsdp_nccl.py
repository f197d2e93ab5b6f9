"""FSDP2 over NCCL on one GPU and on every visible GPU (``make test-gpu``; skipped without CUDA).

The sharding code of ``train.parallel: fsdp`` (:mod:`veriloop.algos.run.fsdp`) on CUDA tensors: the
tiny model's policy is sharded over N GPUs (``torchrun --nproc_per_node N``), three AdamW steps on
a fixed batch are taken, and the gathered weights must equal those of one GPU without FSDP; each
rank must hold about 1/N of the parameters + AdamW state. (The training loop itself keeps its
model on CPU today: see docs/scaling.md.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from veriloop.cli.serve import free_port

WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
from veriloop.agents.testing import tiny_policy
from veriloop.algos.run import fsdp

out, sharded = sys.argv[1], sys.argv[2] == "fsdp"
rank = int(os.environ.get("RANK", "0"))
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
if sharded:
    dist.init_process_group("nccl")
policy = tiny_policy(seed=0)
policy.model.cuda()
if sharded:
    fsdp.shard(policy, None)
opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.tensor([[1, 5, 9, 14, 2, 7, 7, 3]] * 4, device="cuda")
for _ in range(3):
    loss = policy.model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in policy.model.parameters() if p.grad is not None], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
memory = fsdp.training_state_bytes(opt)
if sharded:
    state = fsdp.full_trainable_state(policy, None)
else:
    state = {f"policy.{n}": p.detach().cpu() for n, p in policy.model.named_parameters()}
if rank == 0:
    torch.save(state, os.path.join(out, ("fsdp" if sharded else "single") + ".pt"))
with open(os.path.join(out, f"memory-{'fsdp' if sharded else 'single'}-{rank}.json"), "w") as f:
    json.dump(memory, f)
if sharded:
    dist.destroy_process_group()
"""


def _run(out: Path, mode: str, nproc: int | None = None) -> None:
    """The worker in one plain process (``nproc`` None) or under torchrun with ``nproc`` ranks."""
    worker = out / "worker.py"
    worker.write_text(WORKER)
    launcher = (
        []
        if nproc is None
        else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    )
    done = subprocess.run(
        [sys.executable, *launcher, str(worker), str(out), mode], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("gpus", ["one", "all"])
def test_fsdp2_over_nccl_matches_one_gpu_without_sharding(tmp_path: Path, gpus: str) -> None:
    n = 1 if gpus == "one" else torch.cuda.device_count()
    if gpus == "all" and n < 2:
        pytest.skip(f"one GPU visible ({n}): the all-GPU case needs two or more")
    _run(tmp_path, "single")
    _run(tmp_path, "fsdp", nproc=n)
    one, sharded = (torch.load(tmp_path / f"{m}.pt") for m in ("single", "fsdp"))
    assert set(one) <= set(sharded)
    for k, v in one.items():
        torch.testing.assert_close(sharded[k].float(), v.float(), rtol=0, atol=1e-4)
    whole = sum(json.loads((tmp_path / "memory-single-0.json").read_text()).values())
    fractions = [
        sum(json.loads((tmp_path / f"memory-fsdp-{r}.json").read_text()).values()) / whole for r in range(n)
    ]
    print(f"{n} GPU(s): fraction of parameters + AdamW state per rank {fractions}")
    assert all(abs(f - 1 / n) < 0.05 for f in fractions), fractions
