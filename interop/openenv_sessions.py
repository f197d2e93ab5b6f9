"""The OpenEnv server's session endpoints, with the limits a public server needs.

``openenv_server.create_app`` mounts these in place of OpenEnv's own ``/ws`` and ``/step`` (and
drops its ``/mcp`` routes: a veriloop env has no MCP tools, and OpenEnv's ``/mcp`` WebSocket would
hold an environment per connection with neither our session limit nor the idle timeout):

* ``/ws`` speaks OpenEnv's WebSocket protocol (``reset`` / ``step`` / ``state`` / ``close``
  messages, OpenEnv's response types, so ``EnvClient`` works unchanged), with at most
  ``max_sessions`` sessions at once, each its own environment built and run in its own thread.
* A session with no message for ``idle_timeout_s`` seconds is closed (WebSocket close code
  :data:`CLOSE_IDLE`, the reason in words), so idle clients cannot hold every slot.
* A client refused because every slot is taken gets an error message and the close code
  :data:`CLOSE_BUSY` ("try again later", RFC 6455) with the reason, not a bare close.
* A failed message (a bad reset seed, a step before any reset) is answered with an error and the
  session stays usable: a failed reset rebuilds the environment (see ``VeriloopOpenEnv.reset``).
* HTTP ``POST /step`` answers 409 with what to do: OpenEnv's HTTP routes are stateless (a fresh,
  never reset environment per request), so an episode needs the WebSocket session.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from veriloop.interop._extras import require

_WHAT = "serving veriloop envs over OpenEnv"
_types: Any = require("openenv.core.env_server.types", "openenv", _WHAT)
_serialization: Any = require("openenv.core.env_server.serialization", "openenv", _WHAT)
fastapi: Any = require("fastapi", "openenv", _WHAT)
_responses: Any = require("fastapi.responses", "openenv", _WHAT)
pydantic: Any = require("pydantic", "openenv", _WHAT)

#: Close codes: the server is full ("try again later", RFC 6455), and a session idle too long
#: (application range 4000-4999; 4408 after HTTP's 408 Request Timeout).
CLOSE_BUSY = 1013
CLOSE_IDLE = 4408
#: What HTTP ``POST /step`` answers (status 409 Conflict: there is no episode to step).
HTTP_STEP_HINT = (
    "HTTP /step is stateless in OpenEnv: every request gets a fresh environment that was never "
    "reset, so there is no episode to step. Reset first, in a WebSocket session (/ws; OpenEnv's "
    "EnvClient does this): send reset, then step"
)


class SessionServer:
    """The ``/ws`` endpoint: OpenEnv's protocol, a session limit, an idle timeout.

    Args:
        factory: Builds one session's environment (an OpenEnv ``Environment``).
        action_cls: The action model steps are parsed into.
        max_sessions: Sessions served at once; more clients are refused with :data:`CLOSE_BUSY`.
        idle_timeout_s: A session without a message for this long is closed (:data:`CLOSE_IDLE`).
    """

    def __init__(
        self, factory: Callable[[], Any], action_cls: Any, *, max_sessions: int, idle_timeout_s: float
    ):
        if max_sessions < 1 or not idle_timeout_s > 0:
            raise ValueError(
                f"max_sessions must be >= 1 and idle_timeout_s > 0, got {max_sessions}, {idle_timeout_s}"
            )
        self.factory, self.action_cls = factory, action_cls
        self.max_sessions, self.idle_timeout_s = max_sessions, idle_timeout_s
        self.active = 0  # changed only on the event loop, between awaits: no lock needed

    async def endpoint(self, websocket: Any) -> None:
        await websocket.accept()
        if self.active >= self.max_sessions:
            why = f"server at capacity: {self.active} of {self.max_sessions} sessions in use; retry later"
            await _close(websocket, why, _types.WSErrorCode.CAPACITY_REACHED, CLOSE_BUSY)
            return
        self.active += 1
        executor = ThreadPoolExecutor(max_workers=1)  # one thread per session: envs are not shared
        env = None
        try:
            env = await _run(executor, self.factory)
            await self._serve(websocket, env, executor)
        except fastapi.WebSocketDisconnect:
            pass
        finally:
            self.active -= 1
            if env is not None:
                await _run(executor, _close_quietly, env)
            executor.shutdown(wait=False)

    async def _serve(self, websocket: Any, env: Any, executor: ThreadPoolExecutor) -> None:
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(), self.idle_timeout_s)
            except asyncio.TimeoutError:
                why = (
                    f"session idle for {self.idle_timeout_s:g} s: closed to free its slot; "
                    "reconnect for a new one"
                )
                await _close(websocket, why, "IDLE_TIMEOUT", CLOSE_IDLE)
                return
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:  # a binary frame
                await websocket.send_text(_error("send JSON text frames", _types.WSErrorCode.INVALID_JSON))
                continue
            reply = await self._reply(raw, env, executor)
            if reply is None:  # the client said close
                await websocket.close()
                return
            await websocket.send_text(reply)

    async def _reply(self, raw: str, env: Any, executor: ThreadPoolExecutor) -> str | None:
        """The JSON answer to one client message (None for ``close``); errors never end the session."""
        try:
            message = json.loads(raw)
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "reset":
                data = _types.WSResetMessage(**message).data
                kwargs = {k: data[k] for k in ("seed", "options", "episode_id") if k in data}
                observation = await _run(executor, functools.partial(env.reset, **kwargs))
            elif kind == "step":
                action = _serialization.deserialize_action(
                    _types.WSStepMessage(**message).data, self.action_cls
                )
                observation = await _run(executor, env.step, action)
            elif kind == "state":
                state = env.state
                return _types.WSStateResponse(data=state.model_dump()).model_dump_json()
            elif kind == "close":
                return None
            else:
                return _error(
                    f"unknown message type {str(kind)[:40]!r}: send reset, step, state or close",
                    _types.WSErrorCode.UNKNOWN_TYPE,
                )
            return _types.WSObservationResponse(
                data=_serialization.serialize_observation(observation)
            ).model_dump_json()
        except json.JSONDecodeError as e:
            return _error(f"invalid JSON: {e}", _types.WSErrorCode.INVALID_JSON)
        except pydantic.ValidationError as e:
            return _error(f"invalid message: {str(e)[:400]}", _types.WSErrorCode.VALIDATION_ERROR)
        except Exception as e:  # noqa: BLE001  (the env's own error, reported to the client)
            return _error(f"{type(e).__name__}: {str(e)[:500]}", _types.WSErrorCode.EXECUTION_ERROR)


async def http_step_refused() -> Any:
    """``POST /step``: 409 and :data:`HTTP_STEP_HINT` (see the module docstring)."""
    return _responses.JSONResponse(status_code=409, content={"detail": HTTP_STEP_HINT})


def mount(app: Any, sessions: SessionServer) -> Any:
    """Replace OpenEnv's ``/ws`` and ``POST /step`` routes of ``app`` with ours; drop its ``/mcp``."""
    dropped = ("/ws", "/step", "/mcp")
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in dropped]

    async def ws(websocket: fastapi.WebSocket) -> None:  # FastAPI injects by this annotation
        await sessions.endpoint(websocket)

    app.add_api_websocket_route("/ws", ws)
    app.add_api_route(
        "/step",
        http_step_refused,
        methods=["POST"],
        status_code=409,
        summary="Refused: reset first, in a WebSocket session (/ws)",
    )
    return app


def _error(message: str, code: Any) -> str:
    return _types.WSErrorResponse(data={"message": message, "code": code}).model_dump_json()


async def _close(websocket: Any, why: str, code: Any, close_code: int) -> None:
    """Send ``why`` as an error message, then close with ``close_code`` and ``why`` as the reason
    (cut to the protocol's 123 bytes)."""
    try:
        await websocket.send_text(_error(why, code))
        await websocket.close(code=close_code, reason=why.encode()[:120].decode(errors="ignore"))
    except (RuntimeError, fastapi.WebSocketDisconnect):
        pass  # the client is already gone


async def _run(executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001  (closing a finished session must not raise into the server)
        pass


__all__ = ["CLOSE_BUSY", "CLOSE_IDLE", "HTTP_STEP_HINT", "SessionServer", "http_step_refused", "mount"]
