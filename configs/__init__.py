if (
    __name__ != "veriloop.configs"
):  # the folder configs/ is the package veriloop.configs (pyproject's package-dir)
    raise ImportError(
        f"{__name__!r} is the folder configs/ imported under the wrong name: it is the package "
        "'veriloop.configs'. Write `import veriloop.configs` (or `from veriloop.configs import ...`) and install the "
        f"repository once with `pip install -e .`; importing it as {__name__!r} would make a second, "
        "different copy of every class in it"
    )
