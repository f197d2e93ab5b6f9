"""The OpenEnv server under misuse: idle clients, a full server, HTTP /step, a failed first reset,
a bad id or bad kwargs at start. Each gets a clear answer; no session is lost or poisoned."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from openenv.core import GenericEnvClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from veriloop.interop.openenv_server import create_app, main, serve, serve_app
from veriloop.interop.openenv_sessions import CLOSE_BUSY, CLOSE_IDLE

ENV = "veriloop/Points24-text-v0"


def _ws(base_url: str) -> str:
    return base_url.replace("http://", "ws://") + "/ws"


def _ask(ws, kind: str, data: dict | None = None) -> dict:  # type: ignore[no-untyped-def]
    ws.send(json.dumps({"type": kind, "data": data or {}}))
    return json.loads(ws.recv(timeout=30))


def test_a_refused_client_gets_a_message_and_a_close_reason() -> None:
    with serve(ENV, max_concurrent_envs=1) as url, connect(_ws(url)) as first:
        assert _ask(first, "reset", {"seed": 0})["type"] == "observation"
        with connect(_ws(url)) as second:
            reply = json.loads(second.recv(timeout=10))
            assert (
                reply["data"]["code"] == "CAPACITY_REACHED" and "1 of 1 sessions" in reply["data"]["message"]
            )
            with pytest.raises(ConnectionClosed) as closed:
                second.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_BUSY
        assert "retry later" in closed.value.rcvd.reason
        assert _ask(first, "step", {"response": "1+2"})["type"] == "observation"  # the held session is fine


def test_an_idle_session_is_closed_and_frees_its_slot() -> None:
    """The repro held every slot with idle connections; now each is closed after the timeout."""
    app = create_app(ENV, max_concurrent_envs=1, idle_timeout_s=0.5)
    with serve_app(app) as url:
        with connect(_ws(url)) as idle:
            assert _ask(idle, "reset", {"seed": 0})["type"] == "observation"
            time.sleep(1.0)
            assert json.loads(idle.recv(timeout=10))["data"]["code"] == "IDLE_TIMEOUT"
            with pytest.raises(ConnectionClosed) as closed:
                idle.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_IDLE
            assert "idle" in closed.value.rcvd.reason
        with connect(_ws(url)) as next_client:  # the slot is free again
            assert _ask(next_client, "reset", {"seed": 1})["type"] == "observation"


@pytest.mark.parametrize("bad", [{"seed": "abc"}, {"seed": 0, "options": {"task": "garbage"}}])
def test_a_failed_first_reset_does_not_poison_the_session(bad: dict) -> None:
    """Before, a step after a failed first reset and a good one raised a TypeError for ever."""
    with serve(ENV) as url, connect(_ws(url)) as ws:
        reply = _ask(ws, "reset", bad)
        assert reply["type"] == "error" and (
            "seed" in reply["data"]["message"] or "task" in reply["data"]["message"]
        )
        assert _ask(ws, "reset", {"seed": 1})["type"] == "observation"
        step = _ask(ws, "step", {"response": "1+2"})
        assert step["type"] == "observation" and step["data"]["reward"] < 0  # a wrong answer, judged


def test_step_before_reset_is_a_clear_error_and_the_session_goes_on() -> None:
    with serve(ENV) as url, connect(_ws(url)) as ws:
        reply = _ask(ws, "step", {"response": "1+2"})
        assert reply["type"] == "error" and "send a reset first" in reply["data"]["message"]
        assert _ask(ws, "reset", {"seed": 1})["type"] == "observation"


def test_http_step_says_to_reset_first_in_a_session() -> None:
    """Before: always 500 Internal Server Error (the per-request env was never reset)."""
    with serve(ENV) as url:
        body = json.dumps({"action": {"response": "1+2"}}).encode()
        req = urllib.request.Request(url + "/step", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 409
        assert "Reset first" in json.loads(err.value.read())["detail"]


def test_the_openenv_client_still_plays_an_episode() -> None:
    with serve(ENV, expose_task=True) as url, GenericEnvClient(base_url=url).sync() as client:
        result = client.reset(seed=5)
        assert "24" in result.observation["text"]
        assert client.step({"response": "1+2"}).reward < 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["veriloop/Points24-txt-v0"], "Did you mean"),
        ([ENV, "--kwargs", "{level: 2"], "--kwargs is not valid JSON"),
        ([ENV, "--kwargs", '{"no_such_option": 1}'], "rejects the kwargs"),
        ([ENV, "--kwargs", "[1, 2]"], "must be a JSON object"),
    ],
)
def test_server_cli_refuses_bad_ids_and_kwargs_in_one_line(argv: list[str], expected: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_malformed_frames_are_answered_and_the_session_goes_on() -> None:
    with serve(ENV) as url, connect(_ws(url)) as ws:
        ws.send(b"\x00\x01binary")
        assert json.loads(ws.recv(timeout=30))["data"]["code"] == "INVALID_JSON"
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=30))["data"]["code"] == "INVALID_JSON"
        assert _ask(ws, "dance")["data"]["code"] == "UNKNOWN_TYPE"
        assert _ask(ws, "step", {"no_response": 1})["type"] == "error"
        assert _ask(ws, "reset", {"seed": 2})["type"] == "observation"


def test_openenv_mcp_routes_are_not_served() -> None:
    """OpenEnv 0.10's /mcp would hold an env per connection outside the session limit and idle timeout;
    a veriloop env has no MCP tools, so the server drops the routes."""
    with serve(ENV) as url:
        request = urllib.request.Request(
            url + "/mcp",
            data=b'{"jsonrpc": "2.0", "method": "tools/list", "id": 1}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code in (404, 405)
        with pytest.raises(Exception), connect(url.replace("http://", "ws://") + "/mcp") as ws:  # noqa: B017
            ws.send("{}")
            ws.recv(timeout=10)
