"""An OpenEnv environment, reached through OpenEnv's own client, as a ``gymnasium.Env``.

``pip install 'veriloop[openenv]'``. Any OpenEnv server whose action carries one text field works::

    env = make_openenv_env("http://127.0.0.1:8000")          # e.g. a served veriloop env
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("my answer")

``make_openenv_env`` is ``gymnasium.make`` of an unregistered spec (so wrappers and ``check_env``
see a spec); to train on a remote env by id, register it like any env::

    gymnasium.register("mylab/Remote-v0", entry_point="veriloop.interop.openenv_client:OpenEnvClientEnv",
                       kwargs={"base_url": "http://127.0.0.1:8000"})

The client is OpenEnv's ``GenericEnvClient`` (one WebSocket session, so multi-turn state lives on
the server). Mapping, and where it loses information:

* action ``str`` -> ``{action_field: action}`` (default ``"response"``, what
  :mod:`.openenv_server` expects); other servers name their field (``"message"``, ``"code"``...).
* observation: the server observation's ``text_field`` (default ``"text"``) as the text; with
  ``image_shape`` set, ``{"text", "image"}`` with the image decoded from ``image_field`` (a base64 PNG).
  A server observation without ``text_field`` becomes its JSON dump. The whole server observation is
  in ``info["openenv_observation"]``.
* flags: OpenEnv has one ``done``. When the server also sends ``terminated``/``truncated`` (as
  veriloop's server does) they are used as they are; otherwise ``terminated = done`` and
  ``truncated = False`` -- a server that stopped an episode for a budget is then reported as a
  decided task (``info["done_only"] = True`` says so).
* reward: OpenEnv's ``reward`` (``None`` -> 0.0, with ``info["reward_missing"] = True``).
* ``info["verdict"]`` is the server's verdict dict when it sends one (veriloop's server does);
  a verdict with ``error`` set also gives ``info["verifier_error"]``.
"""

from __future__ import annotations

import json
from typing import Any, cast

import gymnasium
import numpy as np
from gymnasium import spaces

from veriloop.envs.base import MAX_TEXT_CHARS
from veriloop.envs.spaces import UnicodeText
from veriloop.interop._extras import require


class OpenEnvClientEnv(gymnasium.Env):
    """A ``gymnasium.Env`` backed by an OpenEnv server (see the module docstring).

    Args:
        base_url: The server's ``http://host:port`` (or ``ws://``).
        action_field: Name of the action's text field on the server.
        text_field: Name of the observation's text field.
        image_field: Name of the observation's base64 PNG field (used when ``image_shape`` is set).
        image_shape: ``(H, W, 3)`` of the server's images; ``None`` for text-only observations.
        reset_kwargs: Extra keyword arguments sent with every reset (e.g. server-specific options).
        max_text_chars: Bound of the text observation and action spaces.
        message_timeout_s: How long to wait for one server reply.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        base_url: str,
        *,
        action_field: str = "response",
        text_field: str = "text",
        image_field: str = "image_png",
        image_shape: tuple[int, int, int] | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        max_text_chars: int = MAX_TEXT_CHARS,
        message_timeout_s: float = 60.0,
    ) -> None:
        openenv_core = require("openenv.core", "openenv", "OpenEnvClientEnv")
        self.base_url = base_url
        self.action_field = action_field
        self.text_field = text_field
        self.image_field = image_field
        self.image_shape = tuple(image_shape) if image_shape is not None else None
        self.reset_kwargs = dict(reset_kwargs or {})
        self.max_text_chars = int(max_text_chars)
        self.action_space = UnicodeText(max_length=self.max_text_chars)
        text_space = UnicodeText(max_length=self.max_text_chars)
        if self.image_shape is None:
            self.observation_space: spaces.Space[Any] = text_space
        else:
            image_space = spaces.Box(0, 255, self.image_shape, np.uint8)
            self.observation_space = spaces.Dict({"text": text_space, "image": image_space})
        client = openenv_core.GenericEnvClient(base_url=base_url, message_timeout_s=message_timeout_s)
        self._client = client.sync()
        self._client.connect()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        """Start an episode on the server; ``seed`` and ``options`` are forwarded as they are."""
        super().reset(seed=seed)
        kwargs = dict(self.reset_kwargs)
        if seed is not None:
            kwargs["seed"] = int(seed)
        if options is not None:
            kwargs["options"] = options
        result = self._client.reset(**kwargs)
        obs, info = self._convert(result.observation)
        return obs, info

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Send one response; see the module docstring for how flags and reward are mapped."""
        if not isinstance(action, str):
            raise TypeError(f"action must be the model's response as a str, got {type(action).__name__}")
        result = self._client.step({self.action_field: action})
        obs, info = self._convert(result.observation)
        raw = info["openenv_observation"]
        done = bool(result.done)
        if "terminated" in raw and "truncated" in raw:
            terminated, truncated = bool(raw["terminated"]), bool(raw["truncated"])
        else:
            terminated, truncated = done, False
            info["done_only"] = True
        if result.reward is None:
            info["reward_missing"] = True
        return obs, float(result.reward or 0.0), terminated, truncated, info

    def close(self) -> None:
        """Close the WebSocket session (the server drops its env)."""
        if getattr(self, "_client", None) is not None:
            self._client.close()
            self._client = None

    def _convert(self, observation: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if self.text_field in observation:
            text = str(observation[self.text_field])
        else:
            text = json.dumps(observation, default=str)
        text = text[: self.max_text_chars]
        info: dict[str, Any] = {"openenv_observation": observation}
        verdict = observation.get("verdict")
        if verdict is not None:
            info["verdict"] = verdict
            if isinstance(verdict, dict) and verdict.get("error"):
                info["verifier_error"] = verdict["error"]
        if self.image_shape is None:
            return text, info
        from veriloop.interop.openenv_server import decode_png

        encoded = observation.get(self.image_field)
        if encoded is None:
            raise ValueError(f"the server's observation has no {self.image_field!r} field for the image")
        image = decode_png(encoded)
        if image.shape != self.image_shape:
            raise ValueError(f"server image has shape {image.shape}, this env declares {self.image_shape}")
        return {"text": text, "image": image}, info


def make_openenv_env(base_url: str, **kwargs: Any) -> gymnasium.Env:
    """``gymnasium.make`` of an :class:`OpenEnvClientEnv` (with a spec, without registering an id)."""
    from gymnasium.envs.registration import EnvSpec

    spec = EnvSpec(
        id="OpenEnvClient-v0",
        entry_point=cast(Any, OpenEnvClientEnv),
        kwargs={"base_url": base_url, **kwargs},
    )
    return gymnasium.make(spec)
