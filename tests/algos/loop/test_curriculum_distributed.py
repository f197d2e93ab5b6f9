"""The curriculum across data-parallel ranks: two gloo processes draw and gate the same problems.

Each rank plays its share of every round and gathers all groups, so both update the running
success rates with the same groups and make the same difficulty draw at the next step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from veriloop.cli.serve import free_port

WORKER = r"""
import os, sys, torch
import veriloop.algos.loop.train as T
from veriloop.algos.loop.source import collect
from veriloop.algos.loop.parts import TrainerState
try:
    import veriloop.algos.run.setup as S
except ImportError:  # the policy builders before they moved
    S = T
from veriloop.algos.run.distributed import init_distributed, shutdown_distributed
from veriloop.configs.loader import load_config
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict

MathVerifyEnv.check = lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
out = sys.argv[1]
cfg = load_config(None, sys.argv[2:])
dist = init_distributed()
torch.manual_seed(0)
policy = S.build_policy(cfg)
state = TrainerState()
steps = []
for step in range(3):
    state.step = step
    trajs, sampled, metrics = collect(cfg, policy, state, dist)
    steps.append({"trained": [t.seed for t in trajs], "played": [t.seed for t in sampled],
                  "next_seed": state.next_seed, "rates": dict(state.history["curriculum"]["rates"]),
                  "metrics": {k: v for k, v in metrics.items() if k.startswith(("curriculum/", "sampling/"))}})
torch.save(steps, os.path.join(out, f"{dist.rank}.pt"))
shutdown_distributed(dist)
"""
CONFIG = [
    "policy.model=tiny",
    "policy.lora=false",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=grpo",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=1",
    "curriculum.pools_enabled=true",
    "curriculum.gate=true",
    "curriculum.max_rounds=2",
    "curriculum.bucket_keys=[kind]",
    "curriculum.pools={hard: {low: 0, high: 0.5, weight: 1}, easy: {low: 0.5, high: 1, weight: 0.3}}",
]


def test_two_ranks_draw_gate_and_learn_the_same_rates(tmp_path: Path) -> None:
    port = str(free_port())
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), *CONFIG],
            env={**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-3000:]
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert r0 == r1  # the same problems played and trained, the same rates and metrics, every step
    assert all(s["rates"] for s in r0) and r0[-1]["next_seed"] > 12  # rates learned; seeds moved on
    played = [seed for s in r0 for seed in s["played"]]
    assert len(set(played)) * 2 == len(played)  # each problem one group of 2, never played twice
