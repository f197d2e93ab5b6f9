"""Every command and code block of every ``docs/**/*.md`` page runs here, in page order, as the README's do.

The same runner rules as ``tests/test_readme.py`` (whose helpers this file reuses): a block whose first
line is ``# NAME.py`` / ``# NAME.yaml`` is saved into the page's working folder; other ``python``
blocks run there as scripts, with ``load_policy("default")`` pointed at a tiny saved model; ``bash``
lines run one by one, ``veriloop`` commands that take a config with the README's tiny overrides
appended (except the keys the command sets itself); ``VAR=value`` in front of a command sets its
environment; ``make T`` runs as ``make -n T``, ``veriloop serve-vllm`` with ``--print``, and a
``torchrun`` / ``accelerate`` launch of veriloop is checked as the README's vLLM commands are where
vLLM is absent (the launcher exists; the config with its overrides loads and validates); a ``yaml``
block without a file name is a fragment of a config, which must load over the defaults and validate;
``python benchmarks/S.py ARGS`` is checked as the README's inline benchmark commands are; a line
ending in ``&`` (a server left running) must come up, and ``.venv-vllm/bin/veriloop`` runs as the
README's vLLM commands do. Inline `veriloop X`, `make T` and benchmark commands in a page's text (and
in ``CHANGELOG.md``) are checked as the README's are.
Untagged and ``text`` blocks (figures, sample output) are not run, and may hold no
line that looks like a command or code. The Hub cache (``HF_HUB_CACHE``) is a folder in the Hub layout holding a tiny model under
SmolLM2's id, so a page's Hub-id command runs offline. There is no way to skip a block: a page whose
block cannot run here must change the block.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))  # the guides, docs/results/ and docs/reference/
IDS = [p.relative_to(ROOT / "docs").as_posix() for p in PAGES]
_spec = importlib.util.spec_from_file_location("readme_runner", ROOT / "tests" / "test_readme.py")
readme = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(readme)  # type: ignore[union-attr]
#: A line of an untagged or ``text`` block that would be a command or code (such a block must be tagged).
COMMAND_LIKE = re.compile(r"\s*(\$ |veriloop |python |make |pip |import |from \w+ import )")
STAND_IN = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub id a page may name; a tiny model here


def blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in readme.FENCE.finditer(page.read_text())]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from veriloop.agents.loading import save_policy
    from veriloop.agents.testing import tiny_policy

    root = tmp_path_factory.mktemp("hub")
    repo = root / ("models--" + STAND_IN.replace("/", "--"))
    save_policy(tiny_policy(lora=False), repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return root


def test_docs_pages_exist_and_the_readme_links_them() -> None:
    """The README links the site's home, the core guides and every results report; every page is in
    mkdocs.yml's nav (tests/test_docs_site.py: the strict build fails on a page left out)."""
    core = [
        "index.md",
        "environments.md",
        "agents.md",
        "algorithms.md",
        "training.md",
        "data.md",
        "models.md",
        "precision.md",
        "scaling.md",
        "interop.md",
        "reliability.md",
        "verifier-isolation.md",
        "results/index.md",
    ]
    text = (ROOT / "README.md").read_text()
    for page in core:
        assert (ROOT / "docs" / page).is_file(), f"docs/{page} is missing"
        assert f"(docs/{page})" in text, f"the README does not link docs/{page}"
    for report in (ROOT / "docs" / "results").glob("*.md"):
        if report.name != "index.md":
            assert f"(docs/results/{report.name})" in text, (
                f"'Results at a glance' does not link {report.name}"
            )


def test_the_readmes_algorithm_table_is_the_docs_one() -> None:
    """The README keeps the paper -> setting -> preset table; docs/algorithms.md holds it too, row for row."""

    def rows(text: str) -> list[str]:
        lines = text[text.index("| paper technique |") :].splitlines()
        table = lines[: next(i for i, ln in enumerate(lines) if not ln.startswith("|"))]
        return table[2:]

    readme_rows = rows((ROOT / "README.md").read_text())
    assert len(readme_rows) > 20
    assert readme_rows == rows((ROOT / "docs" / "algorithms.md").read_text())


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, hub_cache: Path) -> None:
    from veriloop.agents.loading import save_policy
    from veriloop.agents.testing import tiny_policy

    save_policy(tiny_policy(lora=False), tmp_path / "tiny-model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(hub_cache)}
    for lang, body in blocks(page):
        first = body.splitlines()[0].strip() if body.strip() else ""
        if name := readme.FILE_BLOCK.fullmatch(first):
            (tmp_path / name.group(1)).write_text(body)
        elif lang == "python":
            code = body.replace('load_policy("default")', f'load_policy("{tmp_path / "tiny-model"}")')
            r = subprocess.run(
                [sys.executable, "-c", code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert r.returncode == 0, f"{page.name} python block failed:\n{code}\n{r.stderr[-3000:]}"
        elif lang == "bash":
            for cmd in readme._commands(body.replace("\\\n", " ")):  # a line ending in \ continues
                _run_command(page, cmd, tmp_path, env)
        elif lang == "yaml":  # a fragment of a config: over the defaults it must load and validate
            (tmp_path / "_fragment.yaml").write_text(body)
            from veriloop.configs.loader import load_config

            load_config(tmp_path / "_fragment.yaml").validate()
        elif lang in ("", "text"):  # a figure or a sample of output: never a command
            bad = [ln for ln in body.splitlines() if COMMAND_LIKE.match(ln)]
            assert not bad, (
                f"{page.name}: lines of an untagged/text block look like commands: {bad}; tag it bash"
            )
        else:
            pytest.fail(
                f"{page.name}: a {lang or 'plain'} block that is not a file (# NAME.yaml): {body[:80]!r}"
            )


def _run_command(page: Path, cmd: str, cwd: Path, env: dict[str, str]) -> None:
    words = shlex.split(cmd)
    extra = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        extra[key] = value
    if cmd.endswith("&"):  # a server the reader leaves running: as the README's, it must come up
        readme._background(cmd[:-1].strip(), cwd)
        return
    if words and words[0] == ".venv-vllm/bin/veriloop":  # vLLM's venv: as the README's vLLM commands
        readme._vllm_command(cmd, cwd)
        return
    if words and words[0] == "make":  # as the README's: the target exists (running it would run this suite)
        r = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, f"{page.name}: {cmd}: {r.stderr[-1000:]}"
        return
    if len(words) > 1 and words[0].endswith("python") and words[1].startswith("benchmarks/"):
        _benchmark_command(page, cmd, words[1:])
        return
    if words and words[0] in LAUNCHERS:
        _launcher_command(page, cmd, words)
        return
    if not words or words[0] != "veriloop":
        pytest.fail(f"{page.name}: a bash line this test cannot run: {cmd!r}; teach tests/test_docs.py")
    args = words[1:]
    if args and args[0] == "serve-vllm" and "--print" not in args:
        args.append("--print")  # a server runs until stopped: its command and environment are printed
    if args and args[0] in readme.CONFIG_COMMANDS and "--help" not in args:
        given = {a.split("=", 1)[0] for a in args if "=" in a}
        args += [t for t in readme.TINY if t.split("=", 1)[0] not in given]
    r = subprocess.run(
        [sys.executable, "-m", "veriloop.cli", *args],
        cwd=cwd,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"{page.name} command failed: {cmd}\n{r.stderr[-3000:]}"


#: Commands that start veriloop in several processes (one or many machines).
LAUNCHERS = ("torchrun", "accelerate")


def _launcher_command(page: Path, cmd: str, words: list[str]) -> None:
    """``torchrun ... -m veriloop.cli SUB CONFIG KEY=VALUE...``: as the README's vLLM commands are
    checked where vLLM's venv is absent, the launcher must exist and the config with its overrides must
    load and validate; the processes themselves are tested by the suite (tests/algos/run/test_fsdp.py)."""
    from veriloop.configs.loader import load_config

    launcher = Path(sys.executable).with_name(words[0])
    assert launcher.is_file(), f"{page.name}: {cmd}: {launcher} is missing"
    assert "veriloop.cli" in words, f"{page.name}: {cmd}: the launcher does not run veriloop.cli"
    args = words[words.index("veriloop.cli") + 1 :]
    assert args and args[0] in readme.CONFIG_COMMANDS, f"{page.name}: {cmd}: no veriloop config command"
    load_config(args[1], [a for a in args[2:] if "=" in a and not a.startswith("-")]).validate()


def _benchmark_command(page: Path, cmd: str, args: list[str]) -> None:
    """As the README's inline benchmark commands: the script exists and its ``--help`` names every
    flag given (a benchmark takes minutes; its own tests run its parts)."""
    script = ROOT / args[0]
    assert script.is_file(), f"{page.name}: {cmd}: {script} is missing"
    r = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "usage" in r.stdout.lower(), (
        f"{page.name}: {script} --help: {r.stderr[-1000:]}"
    )
    for flag in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
        assert flag in r.stdout, f"{page.name}: {cmd}: {flag} is not in {script.name} --help"


def test_inline_commands_of_the_pages_exist() -> None:
    """As the README's: `veriloop X`, `make T` and `python benchmarks/S.py ARGS` in a page's text."""
    for page, name in zip(PAGES, IDS):
        readme.check_inline_commands(page.read_text(), name)
    readme.check_inline_commands((ROOT / "CHANGELOG.md").read_text(), "CHANGELOG.md")
