"""The ``veriloop`` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from veriloop.cli.main import run

    return run(argv)
