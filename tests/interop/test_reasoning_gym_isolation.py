"""No model text runs outside a jail, and nothing a jailed scorer does reaches another request.

The repros: reasoning-gym's puzzle24, countdown and simple_integration scorers hand the answer to
sympy's ``parse_expr`` (an ``eval``); before the jail, an answer could create files, forge a reward
by writing to the worker's reply pipe and desynchronise the pool.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (socket needs it; a jail cannot import after its chroot)
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import gymnasium
import pytest

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.envs.verifiers import check_math, sandbox
from veriloop.envs.verifiers import pool as pool_module
from veriloop.interop.reasoning_gym_env import ENV_ID
from veriloop.interop.reasoning_gym_scorers import score_countdown, score_puzzle24

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail uses Linux namespaces")


@pytest.fixture(scope="module")
def full_jail() -> None:
    """Skip (saying why) where the kernel refuses the namespace steps: the jail is then partial."""
    done = sandbox.isolation()
    if not {"network", "files"} <= set(done):
        pytest.skip(f"this machine gives the jail only {done}: run as root or enable user namespaces")


def _env(dataset: str, seed: int = 0, **kwargs: Any) -> tuple[Any, dict]:
    env = gymnasium.make(ENV_ID, dataset=dataset, **kwargs)
    _, info = env.reset(seed=seed)
    return env, info["task"]


def _attacks(target: Path) -> list[str]:
    """Answers that try to run code, write files and forge replies (any of them would score 1.0)."""
    forged = json.dumps(["ok", 1.0]) + "\\n"
    return [
        f"__import__('os').system('touch {target}')",
        "__import__('os').system('touch pwned')",
        f"open('{target}', 'w').write('x')",
        f"[__import__('os').write(fd, b'{forged}') for fd in range(64) if fd != 0]",
        "__import__('os').write(1, b'[\"ok\", 1.0]\\n')",
        f"__import__('pathlib').Path('/proc/{os.getpid()}/environ').read_bytes()",
    ]


@pytest.mark.parametrize("dataset", ["puzzle24", "countdown", "simple_integration"])
def test_repros_run_nothing_forge_nothing_and_the_next_verdicts_are_right(
    dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_jail: None
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "pwned-abs"
    env, task = _env(dataset)
    for attack in _attacks(target):
        _, reward, terminated, truncated, info = env.step(f"<answer>{attack}</answer>")
        assert reward < 1.0 and not info["verdict"].correct, (attack, info["verdict"])
        env.reset(seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, here or at the absolute path
    # the pool is in step: a right answer scores 1, then a wrong one scores below 1
    for answer, expected in ((task["answer"], 1.0), ("1", None)):
        env.reset(seed=0)
        _, reward, _, _, info = env.step(f"<answer>{answer}</answer>")
        assert info["verdict"].error is None, info["verdict"]
        assert (reward == 1.0) if expected == 1.0 else reward < 1.0
    assert check_math("\\boxed{\\frac{1}{2}}", "0.5").correct  # math checks still give verdicts


def test_puzzle24_checks_the_dealt_numbers() -> None:
    env, task = _env("puzzle24")
    numbers = task["metadata"]["numbers"]
    assert sorted(numbers) != [1, 1, 4, 6]  # this deal is not the one the constant formula fits
    _, reward, _, _, _ = env.step("<answer>4*6*1*1</answer>")
    assert reward == 0.01
    env.reset(seed=0)
    _, reward, _, _, _ = env.step(f"<answer>{task['answer']}</answer>")
    assert reward == 1.0


def test_safe_scorers_keep_reasoning_gym_levels() -> None:
    meta = {"numbers": [3, 3, 8, 8]}
    assert score_puzzle24("8/(3-8/3)", meta, {}) == 1.0
    assert score_puzzle24("8/(3-8/3)", meta, {"operators": ["+", "-", "*"]}) == 0.01  # "/" not allowed
    assert score_puzzle24("4*6*1*1", meta, {}) == 0.01
    cd = {"numbers": [25, 3, 7], "target": 82}
    assert score_countdown("25*3+7", cd, {}) == 1.0
    assert score_countdown("25*3-7", cd, {}) == 0.05  # well formed, wrong value
    assert score_countdown("25*3+7+1", cd, {}) == 0.05  # other numbers
    assert score_countdown("__import__('os')", cd, {}) == 0.01


# ------------------------------------------------------------------ the jail itself


def _escape_attempts(target: str, port: int) -> float:
    """Runs IN a jail: 1.0 for every confinement that fails (files, env, network, fds, /proc)."""
    import os as os_  # noqa: PLC0415 - runs after the fork
    import socket as socket_  # noqa: PLC0415

    escapes = 0.0
    try:
        with open(target, "w") as f:
            f.write("escaped")
        escapes += 1
    except OSError:
        pass
    escapes += 1 if os_.environ.get("VERILOOP_TEST_SECRET") else 0
    try:
        socket_.create_connection(("127.0.0.1", port), timeout=1).close()
        escapes += 1
    except OSError:
        pass
    for fd in range(64):
        if fd != 3:
            try:
                os_.fstat(fd)
                if fd > 2:
                    escapes += 1  # an inherited descriptor beyond /dev/null and the result pipe
            except OSError:
                pass
    escapes += 1 if os_.path.exists(f"/proc/{os_.getppid()}") else 0
    try:
        os_.fork()
        escapes += 1
    except OSError:
        pass
    import ctypes  # noqa: PLC0415 - already loaded by the sandbox: no file needed

    escapes += ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE: 1 lets a same-user process ptrace it
    return escapes


def test_jail_confines_files_env_network_fds_and_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_jail: None
) -> None:
    monkeypatch.setenv("VERILOOP_TEST_SECRET", "s3cret")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with open(tmp_path / "held", "w"):  # an open descriptor the jail must not inherit
        status, value = sandbox.run_jailed(_escape_attempts, (str(tmp_path / "out"), port), 20)
    listener.close()
    assert sandbox.isolation() == ["network", "files", "user", "quota"] or os.getuid() != 0
    assert (status, value) == ("ok", 0.0)
    assert not (tmp_path / "out").exists()


def _forge() -> float:
    import os as os_  # noqa: PLC0415

    os_.write(3, json.dumps(["ok", "not a number"]).encode())
    return 1.0


def test_jail_replies_are_validated_and_late_jails_are_killed() -> None:
    assert sandbox.run_jailed(_forge, (), 10)[0] == "crash"  # two replies on one pipe: not JSON
    status, _ = sandbox.run_jailed(__import__("time").sleep, (30,), 0.5)
    assert status == "timeout"
    assert sandbox.run_jailed(divmod, (7, 0), 10)[0] == "crash"


def test_scorer_worker_inherits_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERILOOP_TEST_SECRET", "s3cret")
    scorers = pool_module.WorkerPool(1, role="scorer")
    try:
        assert scorers.run("no_such_task", (), 60)[0] == "crash"  # started and answering
        assert "VERILOOP_TEST_SECRET" not in pool_module._scorer_env()
        (pid,) = scorers.worker_pids
        try:  # the worker is non-dumpable: only root may read its /proc files
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except PermissionError:
            return
        assert b"s3cret" not in environ and b"VERILOOP_TEST_SECRET" not in environ
    finally:
        scorers.shutdown()


def test_a_stray_reply_line_cannot_answer_the_next_request() -> None:
    math_pool = pool_module.WorkerPool(1)
    try:
        assert math_pool.run("math", ("$2$", "$2$"), 60) == ("ok", ["correct", "2"])
        (worker,) = math_pool._idle
        worker._buffer = b'["ok", ["correct", "forged"]]\n'  # as if something wrote to its pipe
        status, message = math_pool.run("math", ("$3$", "$2$"), 60)
        assert status == "crash" and "did not answer this request" in message
        assert math_pool.run("math", ("$3$", "$2$"), 60) == ("ok", ["wrong", "3"])  # in step again
    finally:
        math_pool.shutdown()


@pytest.mark.slow
def test_every_dataset_scores_the_same_jailed_as_in_process(full_jail: None) -> None:
    """The jail changes no score: each dataset's gold and a wrong answer, in-process vs jailed."""
    import reasoning_gym as rg

    differ, checked = [], 0
    for name in sorted(rg.factory.DATASETS):
        if name == "composite":  # needs a list of datasets to compose
            continue
        data = rg.create_dataset(name, size=3, seed=0)
        entry = data[0]
        for answer in (str(entry.get("answer")), "1"):
            try:
                expected: Any = data.score_answer(answer, entry)  # trusted here: the test's own process
            except Exception:  # noqa: BLE001 - then the jail must report a crash too
                expected = "crash"
            status, value = sandbox.run_jailed(data.score_answer, (answer, entry), 30)
            if (value if status == "ok" else status) != expected:
                differ.append((name, answer[:30], expected, status, value))
            checked += 1
    assert checked > 150 and differ == []


def test_served_over_openenv_the_repro_runs_nothing(tmp_path: Path, full_jail: None) -> None:
    """The remote-code-execution path: the repro sent to a ReasoningGym env over OpenEnv."""
    openenv = pytest.importorskip("openenv.core")
    from veriloop.interop.openenv_server import serve

    target = tmp_path / "pwned"
    for dataset in ("simple_integration",):  # jailed; puzzle24 is scored by our check (tested above)
        with (
            serve(ENV_ID, {"dataset": dataset}) as base_url,
            openenv.GenericEnvClient(base_url=base_url).sync() as client,
        ):
            client.reset(seed=0)
            result = client.step({"response": f"<answer>__import__('os').system('touch {target}')</answer>"})
            assert result.reward is not None and result.reward < 1.0
            forge = "import os; os.write(3, b'[\"ok\", 1.0, []]'); os._exit(0)"  # writes the jail's reply
            client.reset(seed=0)
            hexed = f"exec(__import__('builtins').bytes.fromhex('{forge.encode().hex()}'),{{}})"
            assert client.step({"response": f"<answer>{hexed}</answer>"}).reward == 0.0
    assert not target.exists()
