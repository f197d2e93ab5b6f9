"""verifiers 0.4: a served veriloop env through verifiers' own OpenEnv taskset logic.

verifiers 0.4's ``tasksets/openenv`` connects to an OpenEnv server by ``base_url``, reads the action
schema from ``/schema`` and turns each model reply into an action with its ``parse_action``. The test
takes that path against our server (a full verifiers rollout needs an OpenAI-compatible model
endpoint, which CI has not)."""

from __future__ import annotations

import httpx
import pytest
from openenv.core import GenericEnvClient

from veriloop.interop.openenv_server import serve

# verifiers 0.4 pins mcp==2.0.0, openenv 0.10 needs mcp<2: they do not install together, and `make
# setup` installs openenv 0.10 (the `interop` extra); these tests run in `make test-vllm`, whose venv
# holds verifiers 0.4 beside openenv 0.4.1.
_taskset = pytest.importorskip(
    "verifiers.v1.tasksets.openenv.taskset",
    reason="verifiers 0.4 does not import here (it needs mcp==2.0.0; openenv 0.10 needs mcp<2)",
)
OpenEnvConfig, parse_action = _taskset.OpenEnvConfig, _taskset.parse_action


def test_verifiers_openenv_taskset_drives_a_served_env():
    with serve("veriloop/MathVerifyRetry-v0", expose_task=True) as base_url:
        OpenEnvConfig(base_url=base_url)  # verifiers accepts the server as a taskset source
        schema = httpx.get(f"{base_url}/schema", timeout=10).json()["action"]
        assert schema["required"] == ["response"]  # one required text field: raw replies map onto it
        with GenericEnvClient(base_url=base_url).sync() as client:
            gold = client.reset(seed=0).observation["task"]["answer"]
            total = 0.0
            for reply in ("It is \\boxed{987654321}.", f"Then \\boxed{{{gold}}}."):
                result = client.step(parse_action(reply, schema))
                total += result.reward or 0.0  # verifiers sums OpenEnv's per-step rewards
            assert result.done and result.observation["terminated"] and total == 0.0  # -1 then +1


def test_json_replies_are_taken_as_the_action_itself():
    """A loss of the mapping: verifiers parses a JSON reply as the whole action, so an env whose
    answers are JSON (Points24) needs the model to wrap them as {"response": "..."}."""
    schema = {"required": ["response"], "properties": {"response": {"type": "string"}}}
    assert parse_action("8/(3-8/3)", schema) == {"response": "8/(3-8/3)"}
    assert parse_action('{"cards": ["3"], "formula": "3"}', schema) == {"cards": ["3"], "formula": "3"}
