"""Sharded training (``train.parallel: fsdp``, FSDP2) on CPU: two gloo processes, tiny model.

* one update sharded over two ranks gives the single-process weights (full fine-tuning, LoRA,
  and PPO's value head), and each rank holds about half of the parameters + AdamW state;
* a sharded run killed after a checkpoint resumes (torch.distributed.checkpoint) to the weights
  of an uninterrupted run, full fine-tuning and LoRA (whose frozen base is not checkpointed), and
  its final model is the ordinary ``save_policy`` folder;
* a checkpoint that verifies but does not fit the model is one line on every rank, exit 2;
* a checkpoint of 2 ranks resumes on 1 process and one of 1 process on 2 ranks: the weights
  arrive bit for bit, the problem cursor, AdamW's state and the metrics file continue.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from veriloop.algos.learner.batch import collate_tokens
from veriloop.algos.run.distributed import empty_like_row
from veriloop.algos.run.fsdp import decoder_blocks
from veriloop.algos.run.samples import read_samples
from veriloop.cli.serve import free_port

# A deterministic coin as the math check, so that groups have differing rewards (non-zero advantages).
COIN = r"""
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict
MathVerifyEnv.check = lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
"""
UPDATE = (
    COIN
    + r"""
import dataclasses, json, os, sys, torch
import veriloop.algos.loop.train as T
from veriloop.algos.learner.train_batch import SINGLE_PROCESS, train_on_batch
from veriloop.algos.loop.source import collect
from veriloop.algos.loop.parts import TrainerState
import veriloop.algos.run.setup as S
from veriloop.algos.run import fsdp
from veriloop.algos.run.distributed import init_distributed, shutdown_distributed
from veriloop.configs.loader import load_config
from veriloop.agents import forward

paths = {"packed": 0, "kv_cache": 0}  # how the update ran shared prompts


def counted(name, run):
    def call(*args, **kwargs):
        paths[name] += 1
        return run(*args, **kwargs)
    return call


forward._packed_prefix_logits = counted("packed", forward._packed_prefix_logits)
forward._shared_prefix_logits = counted("kv_cache", forward._shared_prefix_logits)
out, single = sys.argv[1], sys.argv[2] == "single"
cfg = load_config(None, sys.argv[3:])
dist = SINGLE_PROCESS if single else dataclasses.replace(init_distributed(), sharded=True)
torch.manual_seed(0)
policy = S.build_policy(cfg)
critic = S.build_critic(cfg, policy)
parts = fsdp.state_modules(policy, critic)
start = {n: p.detach().clone() for n, p in parts.named_parameters() if p.requires_grad}
sharded = None if single else fsdp.shard(policy, critic)
opt = S.build_optimizer(cfg, policy, critic)
if single:  # the batch the two ranks gathered, trained by one process
    trajs = torch.load(os.path.join(out, "batch.pt"), weights_only=False)
else:
    with sharded.gathered():  # each rank samples its own groups with the whole weights
        trajs, _, _ = collect(cfg, policy, TrainerState(), dist)
    if dist.rank == 0:
        torch.save(trajs, os.path.join(out, "batch.pt"))
m = train_on_batch(cfg, policy, critic, opt, trajs, torch.Generator().manual_seed(0), dist)
memory = fsdp.training_state_bytes(opt)  # after the step: AdamW's moments exist
if single:
    after = {n: p.detach() for n, p in parts.named_parameters() if p.requires_grad}
else:
    after = fsdp.full_trainable_state(policy, critic)
name = "single" if single else str(dist.rank)
torch.save({"start": start, "after": after, "grad_norm": m["grad_norm"], "memory": memory,
            "seeds": [t.seed for t in trajs], "paths": paths}, os.path.join(out, name + ".pt"))
shutdown_distributed(dist)
"""
)
TRAIN = (
    COIN
    + r"""
import sys
import veriloop.algos.loop.train as T
from veriloop.configs.loader import load_config

T.train(load_config(None, sys.argv[2:]), resume=sys.argv[1] == "resume", quiet=True)
"""
)
TINY = [
    "policy.model=tiny",
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
#: PPO with a value head on the policy: the head is sharded too, and its loss is a token mean.
CRITIC = ["algo.advantage=gae", "algo.critic=value_head", "algo.loss_agg_constant=8"]


def _start(script: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _two_ranks(
    script: str, args: list[str], env: dict[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """Two processes as ``torchrun --nproc_per_node 2`` starts them (gloo on CPU)."""
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    return [_start(script, args, {**common, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float = 240) -> None:
    """Wait for every process; on a failure the others are killed (they would wait for it until
    the process group's timeout)."""
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _report(name: str, numbers: dict[str, object]) -> None:
    """Measured numbers, printed (``pytest -s``) and kept in ``$VERILOOP_FSDP_REPORT`` when set."""
    print(f"{name}: {json.dumps(numbers)}")
    if os.environ.get("VERILOOP_FSDP_REPORT"):
        with open(os.environ["VERILOOP_FSDP_REPORT"], "a") as f:
            f.write(json.dumps({"test": name, **numbers}) + "\n")


@pytest.mark.parametrize(
    "extra",
    [
        # 6 episodes in mini-batches of 3: rank 0 trains 2 rows, rank 1 one and a padding micro-batch
        ["policy.lora=false", "rollout.prompts_per_step=3", "train.mini_batch_size=3"],
        # a group's two rows in one micro-batch: a shared prompt, packed with the rows in both
        ["policy.lora=true", "train.micro_batch_size=2"],
        pytest.param(["policy.lora=false", *CRITIC], marks=pytest.mark.slow),  # ~1 min more
    ],
    ids=["full", "lora", "full-value_head"],
)
def test_sharded_update_matches_single_process_and_halves_memory(tmp_path: Path, extra: list[str]) -> None:
    args = [str(tmp_path), "fsdp", *TINY, *extra]
    _wait(_two_ranks(UPDATE, args))
    _wait([_start(UPDATE, [str(tmp_path), "single", *TINY, *extra], {})])
    r0, r1, one = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("0", "1", "single"))
    # rank 0 played seeds 0, 2, ..., rank 1 seeds 1, 3, ...; both hold every group, in seed order
    assert r0["seeds"] == r1["seeds"] == [s for s in range(len(r0["seeds"]) // 2) for _ in range(2)]
    assert one["grad_norm"] == pytest.approx(r0["grad_norm"], rel=1e-4) and r0["grad_norm"] == r1["grad_norm"]
    # a sharded model never runs a prompt from its KV cache (its gathered weights would be freed)
    assert r0["paths"]["kv_cache"] == r1["paths"]["kv_cache"] == 0
    shared = "train.micro_batch_size=2" in extra
    assert (r0["paths"]["packed"] > 0 and r1["paths"]["packed"] > 0) == shared, (r0["paths"], r1["paths"])
    assert (one["paths"]["packed"] > 0) == shared, one["paths"]
    assert set(one["after"]) <= set(r0["after"])
    moved = [k for k in one["after"] if not torch.equal(one["after"][k], one["start"][k])]
    assert moved, "the update changed no weight"
    worst = 0.0
    for k in one["after"]:  # AdamW's first step is ~lr * sign(g): rounding moves only g ~ eps entries
        torch.testing.assert_close(r0["after"][k], one["after"][k], rtol=0, atol=1e-3)
        worst = max(worst, float((r0["after"][k] - one["after"][k]).abs().max()))
    whole = sum(one["memory"].values())
    halves = [sum(r["memory"].values()) / whole for r in (r0, r1)]
    _report(
        f"fsdp-update-{'-'.join(extra)}",
        {
            "unsharded_bytes": one["memory"],
            "rank0_bytes": r0["memory"],
            "rank1_bytes": r1["memory"],
            "fraction_per_rank": halves,
            "max_abs_weight_diff": worst,
        },
    )
    assert all(0.45 <= h <= 0.55 for h in halves), halves  # each rank keeps about half
    assert sum(halves) == pytest.approx(1.0, abs=0.01)  # and together they hold it once


#: A resume whose model does not fit the checkpoint (LoRA rank 4, the checkpoint's is 8): through the CLI.
MISFIT = r"""
import sys
import veriloop.agents.testing as testing
from veriloop.agents.loading import LoraSettings
from veriloop.cli.main import run

testing.TINY_LORA = LoraSettings(r=4, alpha=16, dropout=0.0)
sys.exit(run(["train", sys.argv[1], "--resume"]))
"""


def _final_weights(run: Path, kind: str) -> dict[str, torch.Tensor]:
    """The saved final model's weights (a LoRA run's: its adapter's, read from the file)."""
    from safetensors.torch import load_file

    from veriloop.agents.loading import load_policy

    assert json.loads((run / "final" / "veriloop.json").read_text())["kind"] == kind
    if kind == "lora-adapter":  # its base is the tiny random model, which is not a loadable folder
        return load_file(run / "final" / "adapter_model.safetensors")
    policy = load_policy(str(run / "final"))
    return {n: p.detach() for n, p in policy.model.named_parameters()}


def _kill_after_first_checkpoint(procs: list[subprocess.Popen[bytes]], ckpts: Path) -> None:
    deadline = time.time() + 240
    while not (ckpts / "step-000001" / "COMPLETE").exists():
        assert time.time() < deadline and all(p.poll() is None for p in procs), "no first checkpoint"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _misfit_resume_says_so_in_one_line(run: Path) -> None:
    """A checkpoint that verifies but does not fit the model: every rank exits 2 with one line
    saying so (no traceback, no fresh start), and the checkpoint is left as it was."""
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    procs = _two_ranks(MISFIT, [str(run / "config.yaml")])
    for p in procs:
        _, err = p.communicate(timeout=240)
        lines = [line for line in err.decode().splitlines() if line.strip()]
        assert p.returncode == 2, err.decode()[-3000:]
        assert len(lines) == 1 and "does not fit this model" in lines[0], lines
        assert "checksums verify" in lines[0] and "Traceback" not in err.decode(), lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# the LoRA run stays in `make test` (its sharded adapter is the harder resume); full runs in `make test-slow`
@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True], ids=["full", "lora"])
def test_killed_sharded_run_resumes_to_the_uninterrupted_weights(tmp_path: Path, lora: bool) -> None:
    cfg = [
        *TINY,
        f"policy.lora={str(lora).lower()}",
        "train.parallel=fsdp",
        "train.steps=3",
        "run.checkpoint_every=1",
        "run.keep_last=3",
        "eval.every=0",
        "eval.at_start=false",
        "eval.num_problems=1",
        "eval.n_samples=1",
        "eval.k_list=[1]",
        "run.tensorboard=false",
        f"run.out_dir={tmp_path}",
    ]
    straight = _two_ranks(TRAIN, ["fresh", *cfg, "run.name=straight"])
    # the other run: killed once its first checkpoint is committed (each commit waits 3 s first,
    # so step 2's cannot be committed yet); then resumed from that checkpoint
    killed = _two_ranks(TRAIN, ["fresh", *cfg, "run.name=killed"], {"VERILOOP_TEST_SAVE_DELAY": "3"})
    ckpts = tmp_path / "killed" / "checkpoints"
    _kill_after_first_checkpoint(killed, ckpts)
    committed = sorted(p.name for p in ckpts.glob("step-*"))
    assert committed == ["step-000001"] and not (tmp_path / "killed" / "final").exists()
    assert (ckpts / "step-000001" / "model" / "shards" / ".metadata").is_file()
    assert len(list((ckpts / "step-000001" / "model" / "shards").glob("*.distcp"))) == 2  # one file per rank
    if lora:
        _misfit_resume_says_so_in_one_line(tmp_path / "killed")
    _wait(_two_ranks(TRAIN, ["resume", *cfg, "run.name=killed"]))
    _wait(straight)
    kind = "lora-adapter" if lora else "full"
    a, b = _final_weights(tmp_path / "straight", kind), _final_weights(tmp_path / "killed", kind)
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    _report(f"fsdp-resume-{kind}", {"max_abs_weight_diff": diff, "steps": 3, "resumed_from_step": 1})
    assert diff == 0.0, diff  # same data, same order, same sums: bit for bit the same weights
    # the samples log: rank 0's lines alone (one batch's first episodes per step, not one per rank),
    # the killed attempt's uncommitted step dropped on resume, the same episodes as the straight run's
    samples = {name: read_samples(tmp_path / name) for name in ("straight", "killed")}
    assert [r["step"] for r in samples["straight"]] == [s for s in (1, 2, 3) for _ in range(4)]
    assert samples["killed"] == samples["straight"]


def _ranks(n: int, script: str, args: list[str]) -> list[subprocess.Popen[bytes]]:
    """``n`` processes of ``script``: one plain process, or ranks as torchrun starts them."""
    return [_start(script, args, {})] if n == 1 else _two_ranks(script, args)


def _optimizer_steps(ckpt: Path) -> set[int]:
    """AdamW's step counts in a checkpoint (one process's ``optimizer.pt``, or DCP shards read whole)."""
    if (ckpt / "model" / "shards").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt / "model" / "shards", ckpt.parent.parent / "whole.pt")
        state = torch.load(ckpt.parent.parent / "whole.pt", weights_only=False)["optimizer"]["state"]
    else:
        state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    return {int(s["step"]) for s in state.values()}


@pytest.mark.parametrize(
    ("ranks", "lora"),
    [
        pytest.param((2, 1), True, marks=pytest.mark.slow),
        pytest.param((2, 1), False, marks=pytest.mark.slow),
        pytest.param((1, 2), True, marks=pytest.mark.slow),
        pytest.param((1, 2), False, marks=pytest.mark.slow),
    ],  # ~1.5 min each on two cores
    ids=["2to1-lora", "2to1-full", "1to2-lora", "1to2-full"],
)
def test_a_checkpoint_resumes_on_another_number_of_ranks(
    tmp_path: Path, ranks: tuple[int, int], lora: bool
) -> None:
    """Written by ``ranks[0]`` processes at step 1, resumed by ``ranks[1]``: the weights arrive bit
    for bit, then the run continues at step 2 with the problem cursor, AdamW's state and the
    metrics file of the uninterrupted run."""
    cfg = [
        *TINY,
        f"policy.lora={str(lora).lower()}",
        "train.parallel=fsdp",
        "run.checkpoint_every=1",
        "run.keep_last=3",
        "eval.every=0",
        "eval.at_start=false",
        "run.tensorboard=false",
        f"run.out_dir={tmp_path}",
        "run.name=moved",
    ]
    run, kind = tmp_path / "moved", "lora-adapter" if lora else "full"
    _wait(_ranks(ranks[0], TRAIN, ["fresh", *cfg, "train.steps=1"]))
    assert (run / "checkpoints" / "step-000001" / "model" / "shards").is_dir() == (ranks[0] > 1)
    written = _final_weights(run, kind)  # the weights of step 1, saved as final/
    _wait(_ranks(ranks[1], TRAIN, ["resume", *cfg, "train.steps=1"]))  # no step: final/ is what was loaded
    loaded = _final_weights(run, kind)
    assert written.keys() == loaded.keys()
    assert all(torch.equal(written[k], loaded[k]) for k in written), "the weights changed on the way"
    _wait(_ranks(ranks[1], TRAIN, ["resume", *cfg, "train.steps=3"]))
    states = {
        s: json.loads((run / "checkpoints" / f"step-00000{s}" / "trainer_state.json").read_text())["state"]
        for s in (1, 2, 3)
    }
    # the problem cursor: each step plays the next prompts_per_step problems, as without the move
    assert [states[s]["step"] for s in (2, 3)] == [2, 3]
    assert [states[s]["next_seed"] - states[1]["next_seed"] for s in (2, 3)] == [2, 4]
    assert _optimizer_steps(run / "checkpoints" / "step-000003") == {3}  # AdamW's state carried over
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r or "grad_norm" in r] == [1, 2, 3]
    assert all(math.isfinite(r["grad_norm"]) for r in rows if "grad_norm" in r)


def test_decoder_blocks_are_the_layers_of_the_tiny_model() -> None:
    from veriloop.agents.testing import tiny_policy

    model = tiny_policy().model
    assert decoder_blocks(model) == list(model.model.layers) and len(model.model.layers) == 2


def test_padding_micro_batch_has_nothing_to_learn() -> None:
    batch = collate_tokens([[5, 6, 7], [5, 6]], [[0, 1, 1], [0, 1]])
    batch = dataclasses.replace(batch, advantages=torch.ones_like(batch.loss_mask))
    pad = empty_like_row(batch)
    assert pad.size == 1 and float(pad.loss_mask.sum()) == 0 and float(pad.advantages.abs().sum()) == 0
    assert torch.equal(pad.input_ids, batch.input_ids[:1])
