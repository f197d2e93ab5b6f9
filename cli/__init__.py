"""The ``veriloop`` command line."""

from __future__ import annotations

from veriloop.envs._package_name import require_package_name

require_package_name(__name__, "cli")  # the folder cli/ is the package veriloop.cli


def main(argv: list[str] | None = None) -> int:
    from veriloop.cli.main import run

    return run(argv)
