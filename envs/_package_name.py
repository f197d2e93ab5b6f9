"""The guard every package folder runs first: ``envs/``, ``agents/``, ``algos/``, ``configs/``,
``cli/`` and ``interop/`` are the packages ``veriloop.<folder>`` (pyproject's package-dir), and
imported under the bare folder name they would make a second, different copy of every class."""

from __future__ import annotations


def require_package_name(name: str, folder: str) -> None:
    """Raise ImportError saying how to import ``folder`` when it was imported as ``name``."""
    if name != f"veriloop.{folder}":
        raise ImportError(
            f"{name!r} is the folder {folder}/ imported under the wrong name: it is the package "
            f"'veriloop.{folder}'. Write `import veriloop.{folder}` (or `from veriloop.{folder} import ...`) and "
            f"install the repository once with `pip install -e .`; importing it as {name!r} would make a second, "
            "different copy of every class in it"
        )
