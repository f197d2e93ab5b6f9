"""JSON over HTTP to one generation server, with a bounded retry, and errors that name the fix.

Standard library only (``urllib``), so a trainer that talks to ``vllm serve`` needs no vLLM and no
HTTP package. What is retried: a refused or reset connection, a timeout, and HTTP 5xx / 408 / 429
(a server that is starting, restarting or overloaded); each retry waits ``backoff_s``, doubling
(1, 2, 4 ... s). Any other 4xx is the request's fault and fails at once with the server's message.
When the tries run out, :class:`ServerError` says which URL failed, what was tried, for how long,
and how to recover: start the server, then continue the run with ``--resume``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

#: What the error tells a user to do when a server is gone (the README's "Server mode" section).
RECOVERY_HINT = (
    "start it (`veriloop serve-vllm`, see the README's 'Server mode') or point rollout.server.urls at a "
    "live one, then continue the run with `veriloop train RUN_DIR/config.yaml --resume`: it restarts from "
    "the last checkpoint"
)


class ServerError(RuntimeError):
    """A generation server could not be reached, died, or refused a request.

    Attributes:
        url: The server's base URL.
    """

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying one request.

    Attributes:
        retries: Attempts after the first (0 = fail on the first error).
        backoff_s: Wait before the first retry; doubled before each later one.
        timeout_s: Most seconds to wait for one response (a generation request included).
    """

    retries: int = 4
    backoff_s: float = 1.0
    timeout_s: float = 600.0

    @property
    def total_wait_s(self) -> float:
        """Seconds spent waiting between attempts before giving up (timeouts not included)."""
        return self.backoff_s * (2**self.retries - 1)


RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ServerClient:
    """One server at ``url`` (e.g. ``http://127.0.0.1:8000``): ``get`` / ``post`` JSON with retry."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy()) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"server URL {url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000"
            )
        self.url = url.rstrip("/")
        self.retry = retry

    def get(self, path: str, *, quiet_404: bool = False) -> Any:
        """``GET url/path`` as JSON (None when ``quiet_404`` and the route does not exist)."""
        return self.request("GET", path, None, quiet_404=quiet_404)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """``POST url/path`` with a JSON body; the JSON answer (text if not JSON, None if empty)."""
        return self.request("POST", path, body or {})

    def request(self, method: str, path: str, body: dict[str, Any] | None, *, quiet_404: bool = False) -> Any:
        """One request, retried as the module docstring says."""
        started, wait, last = time.monotonic(), self.retry.backoff_s, ""
        for attempt in range(self.retry.retries + 1):
            if attempt:
                time.sleep(wait)
                wait *= 2
            try:
                return self._once(method, path, body)
            except urllib.error.HTTPError as err:
                detail = _error_detail(err)
                if err.code == 404 and quiet_404:
                    return None
                if err.code not in RETRIED_STATUS:
                    raise ServerError(
                        self.url, f"vLLM server {self.url} refused {method} {path}: HTTP {err.code}: {detail}"
                    ) from err
                last = f"HTTP {err.code}: {detail}"
            except (
                urllib.error.URLError,
                http.client.HTTPException,
                OSError,
            ) as err:  # refused, reset, timeout
                last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        tries, spent = self.retry.retries + 1, time.monotonic() - started
        raise ServerError(
            self.url,
            f"vLLM server {self.url} did not answer {method} {path} ({tries} tries over {spent:.0f} s; last: "
            f"{last}). Is it running? {RECOVERY_HINT}",
        )

    def _once(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.retry.timeout_s) as resp:
            raw = resp.read()
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:  # some routes answer plain text (load_lora_adapter: "Success: ...")
            return raw.decode(errors="replace")


def _error_detail(err: urllib.error.HTTPError) -> str:
    """The server's own message from an error response (vLLM sends ``{"error": {"message": ...}}``)."""
    try:
        raw = err.read().decode(errors="replace")
    except OSError:
        return str(err.reason)
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw[:500] or str(err.reason)
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(inner, dict):
        return str(inner.get("message") or inner.get("detail") or inner)[:500]
    return str(inner)[:500]


def check_servers(urls: list[str], retry: RetryPolicy = RetryPolicy()) -> None:
    """Every server answers ``GET /health`` (called at start-up, before any model loads)."""
    if not urls:
        raise ServerError(
            "", f"rollout.backend is vllm_server but rollout.server.urls is empty; {RECOVERY_HINT}"
        )
    for url in urls:
        ServerClient(url, retry).get("/health")
