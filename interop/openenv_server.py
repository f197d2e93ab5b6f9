"""Serve any registered veriloop environment as an OpenEnv environment (``pip install 'veriloop[openenv]'``).

OpenEnv (the ``openenv`` package, 0.10) runs an environment behind a FastAPI app; clients hold one WebSocket
session per episode stream (``/ws``: reset, step, state). This module maps a veriloop id onto it::

    from veriloop.interop.openenv_server import create_app, serve

    app = create_app("veriloop/Points24-vision-v0")          # a FastAPI app, for uvicorn
    with serve("veriloop/MathVerifyRetry-v0") as base_url:   # or: a local server in a thread
        from openenv.core import GenericEnvClient
        with GenericEnvClient(base_url=base_url).sync() as client:
            result = client.reset(seed=0)
            result = client.step({"response": "\\\\boxed{4}"})

or from a shell: ``python -m veriloop.interop.openenv_server veriloop/Points24-text-v0 --port 8000``.

The mapping (each WebSocket session owns its own ``gymnasium.make(env_id, **kwargs)`` instance):

* action: :class:`VeriloopAction` ``{"response": str}`` -> ``env.step(response)``;
* reset: ``{"seed": int, "options": {"task": ...}}`` -> ``env.reset(seed=..., options=...)``;
* observation: :class:`VeriloopObservation` -- ``text``; ``image_png`` (vision envs: the image as a
  base64 PNG string, since the protocol is JSON); ``terminated`` and ``truncated`` kept apart;
  ``verdict`` (``Verdict.to_dict()``), ``reward_components``, ``attempt``, ``verifier_error``.
  OpenEnv's own ``done`` is ``terminated or truncated`` and its ``reward`` the step reward.

What is lost or withheld: clients that read only OpenEnv's ``done`` cannot tell a decided task from a
budget that ran out or a failed verifier (read ``terminated`` / ``truncated`` / ``verifier_error``);
``info["task"]`` (the gold answer) is NOT sent unless ``expose_task=True``, since OpenEnv clients
often show observations to the policy; the HTTP ``/reset`` and ``/step`` routes are stateless in
OpenEnv (a fresh env per request), so episodes need the WebSocket session (OpenEnv's
``EnvClient`` does that) and HTTP ``POST /step`` answers 409 saying so.

Limits (:mod:`veriloop.interop.openenv_sessions`): at most ``max_concurrent_envs`` sessions, each
closed after ``idle_timeout_s`` without a message; a client refused for capacity gets the reason
in an error message and in the close frame (code 1013); a failed reset or a step before any reset
is an error reply and the session stays usable. HTTP ``POST /reset`` with a bad ``seed`` or
``options`` answers 422 with the reason. The id and kwargs are checked when the app is
built, so a typo stops the server at start with one line, not every session later.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast
from uuid import uuid4

import gymnasium
import numpy as np

import veriloop.envs  # noqa: F401  (registers the ids)
from veriloop.interop._extras import require
from veriloop.interop.openenv_sessions import SessionServer, mount

_WHAT = "serving veriloop envs over OpenEnv"
# imported at run time (an optional extra): typed Any so the classes below may subclass them
_types: Any = require("openenv.core.env_server.types", "openenv", _WHAT)
_interfaces: Any = require("openenv.core.env_server.interfaces", "openenv", _WHAT)
_http = require("openenv.core.env_server.http_server", "openenv", _WHAT)
pydantic = require("pydantic", "openenv", _WHAT)


class VeriloopAction(_types.Action):
    """One model response."""

    response: str = pydantic.Field(..., description="The model's full response text for this turn")


class VeriloopObservation(_types.Observation):
    """A veriloop observation plus what Gymnasium's ``info`` says about the step."""

    text: str = pydantic.Field(default="", description="Observation text (task, or verifier feedback)")
    image_png: str | None = pydantic.Field(default=None, description="Vision envs: base64-encoded PNG")
    terminated: bool = pydantic.Field(default=False, description="The task is decided")
    truncated: bool = pydantic.Field(default=False, description="A budget ran out or the verifier failed")
    verdict: dict[str, Any] | None = pydantic.Field(default=None, description="Verdict.to_dict() of the step")
    reward_components: dict[str, float] = pydantic.Field(default_factory=dict)
    attempt: int = pydantic.Field(default=0, description="1-based attempt number of the step (0 at reset)")
    verifier_error: str | None = pydantic.Field(default=None, description="timeout / crash / memory")
    task: dict[str, Any] | None = pydantic.Field(default=None, description="info['task'] if exposed")


def encode_png(image: np.ndarray) -> str:
    """``[H, W, 3]`` uint8 array -> base64 PNG string (lossless)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> np.ndarray:
    """Inverse of :func:`encode_png`."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"), dtype=np.uint8)


class ResetError(ValueError):
    """A reset that the request made fail (a bad ``seed``, or ``options`` the env refuses): HTTP
    ``POST /reset`` answers 422 with the message; over the WebSocket it is an error reply, as any failure."""


async def _reset_refused(request: Any, exc: Exception) -> Any:
    """HTTP ``POST /reset`` with a bad request: 422 and the one-line reason (not a bare 500)."""
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=422, content={"detail": str(exc)})


class VeriloopOpenEnv(_interfaces.Environment):
    """An OpenEnv ``Environment`` around one ``gymnasium.make(env_id, **env_kwargs)`` instance.

    Args:
        env_id: Any registered id (``veriloop/...`` or a user's own).
        env_kwargs: Keyword arguments for ``gymnasium.make``.
        expose_task: Also send ``info["task"]`` (gold answers!) in the observation.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # one gymnasium env per session, nothing shared

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, expose_task: bool = False):
        super().__init__()
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.env = gymnasium.make(env_id, **self.env_kwargs)
        self.expose_task = expose_task
        self._state = _types.State(episode_id=None, step_count=0)
        self._has_episode = False

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> VeriloopObservation:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ResetError(f"reset: seed must be a non-negative integer or null, got {str(seed)[:40]!r}")
        if options is not None and not isinstance(options, dict):
            raise ResetError(
                f'reset: options must be an object (e.g. {{"task": ...}}), got {type(options).__name__}'
            )
        self._has_episode = False
        try:
            obs, info = self.env.reset(seed=seed, options=options)
        except Exception as e:
            # a reset that failed half-way may leave the env (and gymnasium's wrappers) in a state no
            # later reset repairs: start this session over with a fresh env, then report the error
            self.env.close()
            self.env = gymnasium.make(self.env_id, **self.env_kwargs)
            failed = ResetError if options is not None else ValueError  # the client's options, or us
            raise failed(f"reset failed ({type(e).__name__}: {str(e)[:300]}); reset again") from e
        self._state = _types.State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._has_episode = True
        return self._observation(obs, 0.0, False, False, info)

    def step(
        self, action: VeriloopAction, timeout_s: float | None = None, **kwargs: Any
    ) -> VeriloopObservation:
        if not self._has_episode:
            raise RuntimeError("no episode to step: send a reset first (its seed picks the task)")
        obs, reward, terminated, truncated, info = self.env.step(action.response)
        self._state.step_count += 1
        return self._observation(obs, float(reward), terminated, truncated, info)

    @property
    def state(self) -> Any:
        return self._state

    def get_metadata(self) -> Any:
        return _types.EnvironmentMetadata(
            name=self.env_id, description=f"veriloop environment {self.env_id} served over OpenEnv"
        )

    def close(self) -> None:
        self.env.close()

    def _observation(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]
    ) -> VeriloopObservation:
        text, image = (obs["text"], obs["image"]) if isinstance(obs, dict) else (obs, None)
        verdict = info.get("verdict")
        return VeriloopObservation(
            text=str(text),
            image_png=encode_png(image) if image is not None else None,
            terminated=bool(terminated),
            truncated=bool(truncated),
            done=bool(terminated or truncated),
            reward=float(reward),
            verdict=cast(Any, verdict).to_dict() if hasattr(verdict, "to_dict") else verdict,
            reward_components={k: float(v) for k, v in info.get("reward_components", {}).items()},
            attempt=int(info.get("attempt", 0)),
            verifier_error=info.get("verifier_error"),
            task=info.get("task") if self.expose_task else None,
        )


def create_app(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    max_concurrent_envs: int = 8,
    expose_task: bool = False,
    idle_timeout_s: float = 300.0,
) -> Any:
    """OpenEnv's FastAPI app (``openenv.core.env_server.http_server.create_app``) serving ``env_id``,
    with our session endpoints (:mod:`veriloop.interop.openenv_sessions`) in place of its ``/ws``
    and ``POST /step`` (its ``/mcp`` routes dropped).

    Each WebSocket session gets its own env; at most ``max_concurrent_envs`` at once, each closed
    after ``idle_timeout_s`` seconds without a message. The id and ``env_kwargs`` are checked now,
    by building one env (a typo fails here, not on every client).

    Raises:
        ValueError: an unknown id (with Gymnasium's "did you mean") or kwargs the env rejects.
    """
    check_env_args(env_id, env_kwargs)
    # a partial of the class: OpenEnv reads SUPPORTS_CONCURRENT_SESSIONS off it without building an env
    factory = functools.partial(VeriloopOpenEnv, env_id, env_kwargs, expose_task=expose_task)
    app = _http.create_app(
        factory,
        VeriloopAction,
        VeriloopObservation,
        env_name=env_id.replace("/", "_"),
        max_concurrent_envs=max_concurrent_envs,
    )
    sessions = SessionServer(
        factory, VeriloopAction, max_sessions=max_concurrent_envs, idle_timeout_s=idle_timeout_s
    )
    app.add_exception_handler(ResetError, _reset_refused)
    return mount(app, sessions)


def check_env_args(env_id: str, env_kwargs: dict[str, Any] | None) -> None:
    """Build (and close) one ``gymnasium.make(env_id, **env_kwargs)``; ValueError in one line if it fails."""
    try:
        gymnasium.spec(env_id)  # Gymnasium's "did you mean" for an unknown id
    except gymnasium.error.Error as e:
        raise ValueError(f"unknown environment id {env_id!r}: {e}. `veriloop envs` lists them") from None
    if env_kwargs is not None and not isinstance(env_kwargs, dict):
        raise ValueError(f"env kwargs must be a JSON object, got {type(env_kwargs).__name__}")
    try:
        gymnasium.make(env_id, **(env_kwargs or {})).close()
    except Exception as e:  # noqa: BLE001  (whatever the env's constructor raises, in one line)
        raise ValueError(
            f"{env_id} rejects the kwargs {json.dumps(env_kwargs)[:200]}: {str(e)[:300]}"
        ) from None


@contextmanager
def serve_app(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` with uvicorn in a background thread; yields its ``http://host:port`` base URL.

    ``port=0`` picks a free port (the socket is bound before uvicorn starts, so there is no race).
    The server is stopped when the block exits.
    """
    uvicorn = require("uvicorn", "openenv", _WHAT)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the OpenEnv server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serve(env_id: str, env_kwargs: dict[str, Any] | None = None, **app_kwargs: Any) -> Iterator[str]:
    """``serve_app(create_app(env_id, env_kwargs, ...))``: a local OpenEnv server for ``env_id``."""
    with serve_app(create_app(env_id, env_kwargs, **app_kwargs)) as base_url:
        yield base_url


def main(argv: list[str] | None = None) -> int:
    """``python -m veriloop.interop.openenv_server ENV_ID [--host H] [--port P] [--kwargs JSON]
    [--max-sessions N] [--idle-timeout S]``; a bad id or kwargs is one line on stderr and exit 2."""
    import argparse

    parser = argparse.ArgumentParser(description="Serve a veriloop environment over OpenEnv.")
    parser.add_argument("env_id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kwargs", default="{}", help="JSON kwargs for gymnasium.make")
    parser.add_argument("--max-sessions", type=int, default=8, help="WebSocket sessions at once (default 8)")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="close a session after this many seconds without a message (default 300)",
    )
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
        app = create_app(
            args.env_id, kwargs, max_concurrent_envs=args.max_sessions, idle_timeout_s=args.idle_timeout
        )
    except json.JSONDecodeError as e:
        print(
            f"openenv_server: --kwargs is not valid JSON ({e}): pass an object, e.g. '{{\"level\": 2}}'",
            file=sys.stderr,
        )
        return 2
    except ValueError as e:
        print(f"openenv_server: {e}", file=sys.stderr)
        return 2
    uvicorn = require("uvicorn", "openenv", _WHAT)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
