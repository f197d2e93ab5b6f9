"""The README's OpenEnv round trip ends quietly: closing the client is not a server error."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("openenv")

SNIPPET = """
from veriloop.interop.openenv_client import make_openenv_env
from veriloop.interop.openenv_server import serve

with serve("veriloop/Points24-text-v0") as url:
    for _ in range(3):
        env = make_openenv_env(url, action_field="response")
        env.reset(seed=0)
        print(env.step('{"cards": ["A", "8", "5", "4"], "formula": "(1+5)*(8-4)"}')[1])
        env.close()
"""


def test_closing_a_client_logs_no_asgi_error_or_traceback() -> None:
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["10.0"] * 3
    assert "ERROR" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
