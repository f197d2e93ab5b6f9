"""The verifier worker's scorer role serves tasks named as ``"package.module:function"`` strings,
so ``veriloop.envs`` names no upper package (reasoning-gym's scorer lives in ``veriloop.interop``)."""

import pytest

from veriloop.envs.verifiers import _worker


def test_a_scorer_task_is_the_function_its_entry_point_names():
    from veriloop.interop.reasoning_gym_env import SCORER_TASK, score_in_worker

    assert _worker.entry_point(SCORER_TASK) is score_in_worker
    assert _worker.entry_point("os.path:join") is __import__("os").path.join


def test_the_scorer_role_imports_a_task_on_its_first_request():
    tasks = _worker.ROLES["scorer"]
    assert _worker._handle(["r1", "operator:add", [2, 3]], tasks) == ["r1", "ok", 5]
    assert "operator:add" in tasks  # imported once, reused


@pytest.mark.parametrize("name", ["reasoning_gym", "operator:", ":add", "no_such_module_x:f"])
def test_a_task_that_is_not_an_entry_point_is_a_crash_reply_naming_it(name):
    reply = _worker._handle(["r2", name, []], _worker.ROLES["scorer"])
    assert reply[:2] == ["r2", "crash"] and (name in reply[2] or "no_such_module_x" in reply[2])


def test_the_math_role_serves_only_its_own_task():
    assert _worker._handle(["r3", "operator:add", [1, 1]], _worker.ROLES["math"])[1] == "crash"
