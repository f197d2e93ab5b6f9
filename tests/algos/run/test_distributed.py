"""Data parallelism on CPU: two gloo processes, each rolls out its own groups, one update.

Both ranks must end with bitwise identical weights that differ from the start, and the update
must equal the single-process update on the same (gathered) batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from veriloop.algos.run.distributed import DistContext
from veriloop.cli.serve import free_port

WORKER = r"""
import dataclasses, os, sys, torch
from veriloop.algos.learner.train_batch import SINGLE_PROCESS, train_on_batch
from veriloop.algos.loop.source import collect
from veriloop.algos.loop.parts import TrainerState
import veriloop.algos.run.setup as S
from veriloop.algos.run.distributed import init_distributed, check_params_equal, shutdown_distributed
from veriloop.configs.loader import load_config
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict

# a deterministic coin as the math check, so that groups have differing rewards (non-zero advantages)
MathVerifyEnv.check = lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
out, single = sys.argv[1], sys.argv[2] == "single"
cfg = load_config(None, sys.argv[3:])
dist = init_distributed() if not single else SINGLE_PROCESS
torch.manual_seed(0)
policy = S.build_policy(cfg)
critic = S.build_critic(cfg, policy)
opt = S.build_optimizer(cfg, policy, critic)
start = {k: v.clone() for k, v in S.trainable_state(policy, critic).items()}
if single:  # the batch both ranks gathered, trained by one process
    trajs = torch.load(os.path.join(out, "batch.pt"), weights_only=False)
else:
    trajs, _, _ = collect(cfg, policy, TrainerState(), dist)
    # uneven ranks: the first episode trains on 5 fewer tokens (its first ones), so a rank's share
    # of the tokens differs from its share of the sequences
    t0, turn = trajs[0], trajs[0].turns[0]
    cut = [0 if turn.start <= i < turn.start + 5 else m for i, m in enumerate(t0.loss_mask)]
    trajs[0] = dataclasses.replace(t0, loss_mask=cut)
    if dist.rank == 0:
        torch.save(trajs, os.path.join(out, "batch.pt"))
m = train_on_batch(cfg, policy, critic, opt, trajs, torch.Generator().manual_seed(0), dist)
after = S.trainable_state(policy, critic)
same = check_params_equal(dist, list(after.values()))
logged = {k: m[k] for k in ("loss/policy", "loss/value", "entropy", "approx_kl", "mean_token_prob", "mismatch/tokens")}
torch.save({"start": start, "after": after, "same": same, "grad_norm": m["grad_norm"], "logged": logged,
            "seeds": [t.seed for t in trajs]}, os.path.join(out, f"{'single' if single else dist.rank}.pt"))
shutdown_distributed(dist)
"""
CONFIG = [
    "policy.model=tiny",
    "policy.lora=false",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=rloo",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=1",
    "train.lr=1e-2",
]


def _run(out: Path, mode: str, env: dict[str, str], extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(out), mode, *CONFIG, *extra],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-3000:]


#: With a critic (PPO's value head on the policy): the value loss is a token mean while the policy
#: loss may be a sequence mean; each rank's share must be right for both.
CRITIC = ("algo.advantage=gae", "algo.critic=value_head", "algo.loss_agg_constant=8")


@pytest.mark.parametrize(
    "extra",
    [
        (),
        *[
            (*CRITIC, f"algo.loss_agg={agg}")
            for agg in ("token_mean", "seq_mean_token_mean", "seq_sum_constant")
        ],
    ],
    ids=["rloo", "critic-token_mean", "critic-seq_mean_token_mean", "critic-seq_sum_constant"],
)
def test_two_ranks_hold_identical_updated_weights(tmp_path: Path, extra: tuple[str, ...]) -> None:
    port = str(free_port())
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    _wait([_run(tmp_path, "dist", {**common, "RANK": str(r), "LOCAL_RANK": str(r)}, extra) for r in range(2)])
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert r0["same"] and r1["same"]
    assert r0["seeds"] == r1["seeds"] == [0, 0, 1, 1]  # rank 0 played seed 0, rank 1 seed 1; both hold all
    assert all(torch.equal(r0["after"][k], r1["after"][k]) for k in r0["after"])
    moved = [k for k in r0["after"] if not torch.equal(r0["after"][k], r0["start"][k])]
    assert moved, "the update changed no weight"
    # the same batch in one process: the summed shard gradients are the whole batch's gradient
    _wait([_run(tmp_path, "single", {"OMP_NUM_THREADS": "1"}, extra)])
    one = torch.load(tmp_path / "single.pt", weights_only=False)
    assert one["grad_norm"] == pytest.approx(r0["grad_norm"], rel=1e-4)
    # the logged losses, rates and mismatch are the whole batch's on every rank, not a rank's part
    for k, v in one["logged"].items():
        assert r0["logged"][k] == r1["logged"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert one["logged"]["mismatch/tokens"] > 0
    for k in one["after"]:  # AdamW's first step is ~lr * sign(g): rounding moves only g ~ eps entries
        torch.testing.assert_close(one["after"][k], r0["after"][k], rtol=0, atol=1e-3)


def test_shard_and_gather_single_process() -> None:
    ctx = DistContext()
    assert ctx.shard(range(5)) == [0, 1, 2, 3, 4] and ctx.gather_shards([1, 2]) == [1, 2]
    assert DistContext(rank=1, world_size=2).shard(range(5)) == [1, 3]
    assert ctx.grad_sync(0.5)([], True) is True  # single process: nothing to communicate
