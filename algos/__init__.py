if __name__ != "veriloop.algos":  # the folder algos/ is the package veriloop.algos (pyproject's package-dir)
    raise ImportError(
        f"{__name__!r} is the folder algos/ imported under the wrong name: it is the package "
        "'veriloop.algos'. Write `import veriloop.algos` (or `from veriloop.algos import ...`) and install the "
        f"repository once with `pip install -e .`; importing it as {__name__!r} would make a second, "
        "different copy of every class in it"
    )
