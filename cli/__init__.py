"""The ``veriloop`` command line."""

from __future__ import annotations

if __name__ != "veriloop.cli":  # the folder cli/ is the package veriloop.cli (pyproject's package-dir)
    raise ImportError(
        f"{__name__!r} is the folder cli/ imported under the wrong name: it is the package "
        "'veriloop.cli'. Write `import veriloop.cli` (or `from veriloop.cli import ...`) and install the "
        f"repository once with `pip install -e .`; importing it as {__name__!r} would make a second, "
        "different copy of every class in it"
    )


def main(argv: list[str] | None = None) -> int:
    from veriloop.cli.main import run

    return run(argv)
