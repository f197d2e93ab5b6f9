"""HTTP ``POST /reset`` with bad ``options``: a 422 naming the problem, not a bare 500."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openenv.core")

from veriloop.interop.openenv_server import serve  # noqa: E402

ENV = "veriloop/Points24-text-v0"


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/reset", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:  # a bare "Internal Server Error"
            return err.code, {"detail": raw.decode(errors="replace")}


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ("abc", "options must be an object"),
        ([1, 2], "options must be an object"),
        ({"task": "garbage"}, "needs four cards"),
        ({"task": ["QS", "3C"]}, "needs four cards"),
    ],
)
def test_bad_options_get_a_422_with_the_reason(options: object, says: str) -> None:
    with serve(ENV) as url:
        status, body = _post(url, {"seed": 0, "options": options})
        assert status == 422 and says in body["detail"], (status, body)
        status, body = _post(url, {"seed": 0})  # the server is fine
        assert status == 200 and "24" in body["observation"]["text"]
