"""MkDocs hooks for the docs site (``mkdocs.yml``'s ``hooks``; not a page, ``exclude_docs`` leaves it out).

* The API reference: the package folders (``envs/``, ``agents/``, ...) become ``veriloop.*`` only
  through the editable install, so griffe (mkdocstrings) reads them from ``build/docs-api/veriloop``,
  a folder of links made here, as ``make lint`` does for mypy.
* Links out of ``docs/``: a page links a repository file (``../benchmarks/results/vs_trl.json``,
  ``../../examples/rollout_points24.py``) by its path from the page, so that the link works where the
  Markdown is read (GitHub, an editor). The site has no such file, so the linked file is copied into
  the site under its repository path and the link rewritten to that copy. A link to a repository file
  that does not exist, or to a Markdown file outside ``docs/`` (no page of the site), is a warning,
  which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.veriloop")
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envs", "agents", "algos", "configs", "cli", "interop")
#: ``](target)`` of a Markdown link or image; the target ends at a space (a title), ``#`` or ``)``.
LINK = re.compile(r"(\]\()([^)\s#]+)")


@event_priority(100)  # before mkdocstrings' on_config, which keeps only the `paths` that exist then
def on_config(config: Any) -> Any:
    tree = ROOT / "build" / "docs-api" / "veriloop"
    tree.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = tree / name
        if not link.is_symlink():
            try:
                link.symlink_to(Path("..", "..", "..", name))
            except FileExistsError:  # another build (a parallel test worker) made it meanwhile
                pass
    # `mkdocs` started as .venv/bin/mkdocs puts .venv/bin on sys.path, whose `veriloop` console script
    # griffe would take for a part of the package
    sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "veriloop").is_file()]
    return config


def _outside(page_uri: str, target: str) -> str | None:
    """The repository path a page's link points to when it leaves ``docs/``, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    if not path.startswith("../"):
        return None
    return path[len("../") :]


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"])
    wanted: set[str] = set()
    for file in files.documentation_pages():
        text = (docs / file.src_uri).read_text(encoding="utf-8")
        for m in LINK.finditer(text):
            repo_path = _outside(file.src_uri, m.group(2))
            if repo_path is None:
                continue
            if repo_path.endswith(".md"):
                log.warning(
                    "%s links %s: a Markdown file outside docs/ is no page of the site",
                    file.src_uri,
                    repo_path,
                )
            elif (ROOT / repo_path).is_file():
                wanted.add(repo_path)
            else:
                log.warning("%s links %s, which is not a file of the repository", file.src_uri, repo_path)
    for repo_path in sorted(wanted):
        if files.get_file_from_path(repo_path) is None:
            files.append(File(repo_path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    uri = page.file.src_uri

    def swap(m: re.Match[str]) -> str:
        repo_path = _outside(uri, m.group(2))
        if repo_path is None:
            return m.group(0)
        return m.group(1) + posixpath.relpath(repo_path, posixpath.dirname(uri) or ".")

    return LINK.sub(swap, markdown)
