"""The docs site builds: ``mkdocs build --strict`` (Material theme, the API reference from docstrings).

Strict mode turns every warning into a failure: a link to a page or a repository file that does not
exist, an anchor that no heading makes, a page under ``docs/`` that ``mkdocs.yml``'s ``nav`` leaves
out, an API object mkdocstrings cannot find. ``make docs`` runs the same build.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        html = (
            site / page.with_suffix("") / "index.html"
            if page.name != "index.md"
            else site / page.parent / "index.html"
        )
        assert html.is_file(), f"docs/{page} was not built into {html}"


def test_the_api_reference_is_generated_from_docstrings(site: Path) -> None:
    envs = (site / "reference" / "envs" / "index.html").read_text()
    for name in ("VerifierEnv", "Verdict", "register_dataset_env", "LearnerSignal"):
        assert name in envs, f"the envs reference lacks {name}"
    # a sentence of VerifierEnv's own docstring, so the page is generated, not written by hand
    doc = (ROOT / "envs" / "base.py").read_text().split("class VerifierEnv", 1)[1].split('"""')[1]
    assert doc.strip().split("\n")[0][:40] in envs
    assert "load_policy" in (site / "reference" / "agents" / "index.html").read_text()
    assert "AlgoConfig" in (site / "reference" / "configs" / "index.html").read_text()
    maths = (site / "reference" / "maths" / "index.html").read_text()
    for name in ("clipped_pg_loss", "group_normalized"):
        assert name in maths, f"the maths reference lacks {name}"


def test_files_a_page_links_outside_docs_are_copied_into_the_site(site: Path) -> None:
    assert (site / "benchmarks" / "results" / "vs_trl.json").is_file()
    report = (site / "results" / "vs_trl" / "index.html").read_text()
    assert 'href="../../benchmarks/results/vs_trl.json"' in report


def test_the_config_makes_every_warning_fatal() -> None:
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    assert cfg["validation"]["nav"]["omitted_files"] == "warn"  # a page left out of nav fails
    assert cfg["validation"]["links"]["not_found"] == "warn"  # a broken link fails
    assert cfg["validation"]["links"]["anchors"] == "warn"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_link_to_a_missing_repository_file_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mkdocs.config import load_config
    from mkdocs.structure.files import File, Files

    hooks = _hooks()
    assert (
        hooks._outside("results/x.md", "../../benchmarks/results/vs_trl.json")
        == "benchmarks/results/vs_trl.json"
    )
    assert hooks._outside("results/x.md", "../index.md") is None  # inside docs/: MkDocs checks it
    assert hooks._outside("x.md", "https://example.org/a.json") is None
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "x.md").write_text(
        "[gone](../benchmarks/results/no_such_file.json) [md](../README.md) [ok](../benchmarks/results/vs_trl.json)\n"
    )
    config = load_config(str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    files = Files([File("x.md", str(docs), str(tmp_path / "site"), True)])
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.veriloop"):
        hooks.on_files(files, config)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "no_such_file.json" in warned and "README.md" in warned, warned
    assert "vs_trl.json" not in warned
    assert files.get_file_from_path("benchmarks/results/vs_trl.json") is not None  # copied into the site
    page = SimpleNamespace(file=SimpleNamespace(src_uri="results/x.md"))
    out = hooks.on_page_markdown("![a](../../benchmarks/results/a.png) [b](../other.md)", page=page)
    assert out == "![a](../benchmarks/results/a.png) [b](../other.md)"
