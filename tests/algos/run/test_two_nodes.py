"""Two nodes on one machine: ``torchrun --nnodes 2 --nproc_per_node 1`` started twice, the launchers
meeting at a c10d rendezvous on localhost, as two machines' launchers meet at one of them.

Each launcher stands for a node: its own process group (killed as a node dies), its own working
folder and temporary folder; the run folder is the one thing both see (a shared file system: each
FSDP rank writes its shard of a checkpoint into it and reads it back on ``--resume``). A sharded
run trains on a rank of each node, commits its step-1 checkpoint, loses a node (SIGKILL to its
launcher and worker), and is resumed by two new launchers; it ends with the weights of an
uninterrupted two-node run, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from veriloop.cli.serve import free_port

WORKER = r"""
import sys
from veriloop.envs.math_env import MathVerifyEnv
from veriloop.envs.verifiers import Verdict
import veriloop.algos.loop.train as T
from veriloop.configs.loader import load_config

# a deterministic coin as the math check, so that groups have differing rewards
MathVerifyEnv.check = lambda self, r, task: Verdict(correct=len(r) % 2 == 0, reason="coin")
T.train(load_config(None, sys.argv[2:]), resume=sys.argv[1] == "resume", quiet=True)
"""
CONFIG = [
    "policy.model=tiny",
    "policy.lora=true",
    "train.parallel=fsdp",
    "env.id=veriloop/MathVerify-v0",
    "env.kwargs={level: 1}",
    "run.algo_preset=rloo",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=256",
    "train.micro_batch_size=1",
    "train.lr=1e-2",
    "train.steps=3",
    "run.checkpoint_every=1",
    "run.keep_last=3",
    "eval.every=0",
    "eval.at_start=false",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "run.tensorboard=false",
]


def _node(
    tmp: Path, node: str, port: int, job: str, args: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """One node's launcher: ``torchrun --nnodes 2 --nproc_per_node 1`` in its own folder and session."""
    home = tmp / "nodes" / job / node
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        job,
        "--max_restarts",
        "0",
        str(tmp / "worker.py"),
        *args,
    ]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(home / "tmp"), **(env or {})}
    return subprocess.Popen(
        cmd, cwd=home, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )


def _cluster(
    tmp: Path, job: str, args: list[str], env: dict[str, str] | None = None, port: int | None = None
) -> list[subprocess.Popen[bytes]]:
    port = port or free_port()
    return [_node(tmp, n, port, job, args, env) for n in ("node0", "node1")]


def _two_ports() -> tuple[int, int]:
    """Two distinct free ports (both held while the second is picked)."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


def _wait(nodes: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    try:
        for p in nodes:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err.decode()[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                _kill_node(p)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (torchrun starts each rank in a session of its own, so a signal
    to the launcher's process group does not reach it)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile
        parents.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_node(launcher: subprocess.Popen[bytes]) -> None:
    """A node dies: its launcher and every rank it started, at once (SIGKILL)."""
    for pid in [launcher.pid, *_descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "final" / "adapter_model.safetensors")


@pytest.mark.slow  # ~45 s: two torchrun agents, a kill and a resume (`make test-slow`, CI)
def test_a_two_node_run_loses_a_node_and_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    cfg = [*CONFIG, f"run.out_dir={tmp_path / 'shared'}"]
    ports = _two_ports()
    straight = _cluster(tmp_path, "straight", ["fresh", *cfg, "run.name=straight"], port=ports[0])
    # each checkpoint's commit waits 3 s first, so step 2's cannot be committed when step 1's is seen
    killed = _cluster(
        tmp_path, "killed", ["fresh", *cfg, "run.name=killed"], {"VERILOOP_TEST_SAVE_DELAY": "3"}, ports[1]
    )
    ckpts = tmp_path / "shared" / "killed" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts / "step-000001" / "COMPLETE").exists():
        assert time.time() < deadline and all(p.poll() is None for p in killed), "no first checkpoint"
        time.sleep(0.05)
    ranks = _descendants(killed[1].pid)
    assert ranks, "node 1's launcher started no rank"
    _kill_node(killed[1])  # node 1 is gone: its launcher and its rank
    t0 = time.time()
    try:  # node 0's rank loses its peer in the next collective; its launcher ends the job
        killed[0].wait(timeout=120)
    finally:
        survivor = killed[0].returncode
        if survivor is None:
            _kill_node(killed[0])
    print(f"node 0's launcher exited {survivor} {time.time() - t0:.1f} s after node 1 was killed")
    assert survivor not in (None, 0), "the surviving node carried on alone"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000001"]
    shards = ckpts / "step-000001" / "model" / "shards"
    assert len(list(shards.glob("*.distcp"))) == 2  # one file per rank, one rank per node
    _wait(_cluster(tmp_path, "resumed", ["resume", *cfg, "run.name=killed"]))
    _wait(straight)
    run = tmp_path / "shared" / "killed"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2, 3]
    a, b = _adapter(tmp_path / "shared" / "straight"), _adapter(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
