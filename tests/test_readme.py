"""Every command and code block in the README runs here, on the tiny model or with tiny overrides.

A README edit that breaks a command breaks this suite. What each kind of snippet gets:

* a fenced block whose first line is ``# NAME.py`` or ``# NAME.yaml`` is a file the reader saves:
  it is written into the working folder of the blocks that follow (and must import / load);
* other ``python`` blocks run as scripts in that folder, with ``load_policy("default")`` pointed at a
  tiny saved model (the only substitution);
* ``bash`` blocks run line by line in that folder: ``veriloop ...`` with tiny overrides appended to
  the commands that take a config, ``make T`` as ``make -n T`` (it would run this suite);
* inline commands: ``veriloop X`` must be a real subcommand, ``make T`` a real target, and
  ``python benchmarks/S.py ARGS`` must exist with every flag and positional of ARGS in its ``--help``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
FILE_BLOCK = re.compile(r"# ([\w.-]+\.(?:py|yaml))$")
CONFIG_COMMANDS = ("train", "sft", "eval", "quickstart")
#: Appended to every README command that takes a config: the tiny model and a budget of seconds.
TINY = [
    "policy.model=tiny",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_context=768",
    "train.steps=1",
    "train.micro_batch_size=2",
    "train.mini_batch_size=null",
    "train.warmup_steps=0",
    "eval.num_problems=1",
    "eval.n_samples=1",
    "eval.k_list=[1]",
    "eval.every=0",
    "eval.greedy=false",
    "sft.examples=4",
    "run.tensorboard=false",
    "run.checkpoint_every=0",
]


#: vLLM's engine needs a real model folder, so the README's vLLM command keeps the default model.
TINY_VLLM = [t for t in TINY if not t.startswith("policy.model")] + ["sft.steps=0", "eval.at_start=false"]


def fenced() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README)]


def file_blocks() -> dict[str, str]:
    out = {}
    for _, body in fenced():
        first = body.splitlines()[0] if body.strip() else ""
        if m := FILE_BLOCK.fullmatch(first.strip()):
            out[m.group(1)] = body
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reader's folder: the README's files saved in it, and a tiny model to stand in for the default."""
    from veriloop.agents.loading import save_policy
    from veriloop.agents.testing import tiny_policy

    d = tmp_path_factory.mktemp("reader")
    for name, body in file_blocks().items():
        (d / name).write_text(body)
    save_policy(tiny_policy(lora=False), d / "tiny-model")
    return d


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_every_fenced_block_is_of_a_kind_this_file_runs() -> None:
    kinds = {lang for lang, _ in fenced()}
    assert kinds <= {"python", "bash", "yaml"}, f"add a runner for {kinds - {'python', 'bash', 'yaml'}}"
    for lang, body in fenced():
        if lang == "yaml":
            assert FILE_BLOCK.fullmatch(body.splitlines()[0].strip()), (
                f"yaml block without a file name: {body[:80]}"
            )


def test_file_blocks_import_and_load(workdir: Path) -> None:
    for name in file_blocks():
        if name.endswith(".py"):
            r = run([sys.executable, "-c", f"import {name[:-3]}"], workdir)
            assert r.returncode == 0, r.stderr[-2000:]
        else:
            r = run(
                [
                    sys.executable,
                    "-c",
                    f"from veriloop.configs.loader import load_config; load_config({name!r})",
                ],
                workdir,
            )
            assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize(
    "index",
    [
        i
        for i, (lang, body) in enumerate(fenced())
        if lang == "python" and not FILE_BLOCK.fullmatch(body.splitlines()[0].strip())
    ],
)
def test_python_block_runs(index: int, workdir: Path) -> None:
    code = fenced()[index][1].replace('load_policy("default")', f'load_policy("{workdir / "tiny-model"}")')
    r = run([sys.executable, "-c", code], workdir)
    assert r.returncode == 0, f"README python block {index} failed:\n{code}\n{r.stderr[-3000:]}"


def _commands(body: str) -> list[str]:
    lines = [ln.split("  #")[0].strip() for ln in body.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _veriloop(cmd: str, cwd: Path) -> None:
    args = shlex.split(cmd)[1:]
    if args and args[0] in CONFIG_COMMANDS and "--help" not in args:
        args += TINY
    r = run([sys.executable, "-m", "veriloop.cli", *args], cwd)
    assert r.returncode == 0, f"README command failed: {cmd}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(fenced()) if lang == "bash"])
def test_bash_block_runs(index: int, workdir: Path) -> None:
    for cmd in _commands(fenced()[index][1]):
        if cmd.startswith("make "):
            r = run(["make", "-n", *shlex.split(cmd)[1:]], ROOT)
            assert r.returncode == 0, f"{cmd}: {r.stderr}"
        elif cmd.startswith("veriloop "):
            _veriloop(cmd, workdir)
        elif cmd.startswith(".venv-vllm/bin/veriloop "):
            _vllm_command(cmd, workdir)
        elif cmd.endswith("&"):  # a server the reader leaves running: it must come up and stay up
            _background(cmd[:-1].strip(), workdir)
        else:
            pytest.fail(f"README bash line this test cannot run: {cmd!r}; teach tests/test_readme.py")


def _vllm_command(cmd: str, cwd: Path) -> None:
    """A command for vLLM's own venv (``make setup-vllm``): run it there when that venv exists (as in
    CI after ``make test-vllm`` set it up), else check its config and that the target exists. The
    real engine is tested by tests/agents/test_vllm_backend.py under ``make test-vllm``."""
    args = shlex.split(cmd)
    assert run(["make", "-n", "setup-vllm"], ROOT).returncode == 0
    if (ROOT / args[0]).exists():
        r = run([str(ROOT / args[0]), *args[1:], *TINY_VLLM], cwd)
        assert r.returncode == 0, f"README command failed: {cmd}\n{r.stderr[-3000:]}"
    else:
        from veriloop.configs.loader import load_config

        load_config(args[2], [a for a in args[3:] if "=" in a])


def _background(cmd: str, cwd: Path) -> None:
    import socket
    import time

    args = shlex.split(cmd)
    args[0] = sys.executable if args[0] == "python" else args[0]
    port = int(args[args.index("--port") + 1]) if "--port" in args else None
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            assert proc.poll() is None, f"{cmd} exited: {proc.stderr.read()[-2000:]}"  # type: ignore[union-attr]
            with socket.socket() as s:
                if port is not None and s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.5)
        pytest.fail(f"{cmd}: nothing listening on port {port} after 120 s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:veriloop|make|python benchmarks/)[^`]*)`")


def test_inline_commands_exist() -> None:
    check_inline_commands(README, "README")


#: ``--help`` output by command, shared by every page checked in one session.
_HELPS: dict[str, str] = {}


def _help(cmd: list[str]) -> str:
    return run([*cmd, "--help"], ROOT).stdout


def check_inline_commands(text: str, where: str) -> None:
    """Every inline `veriloop X` is a subcommand, `make T` a target, `python benchmarks/S.py ARGS` a
    script whose ``--help`` names every flag and positional suite of ARGS (tests/test_docs.py uses it too)."""
    sub = _HELPS.get("veriloop") or _HELPS.setdefault(
        "veriloop", _help([sys.executable, "-m", "veriloop.cli"])
    )
    helps = _HELPS  # each --help runs once per session, whatever the number of pages
    for m in INLINE.finditer(text):
        words = [w for w in shlex.split(m.group(1)) if not re.fullmatch(r"[A-Z_]+=\S+", w)]
        if len(words) < 2:
            continue  # a bare word such as `veriloop` or `make` names, it does not command
        if words[0] == "veriloop":
            assert words[1] in sub, f"{where}: `{m.group(1)}`: no subcommand {words[1]!r}"
        elif words[0] == "make":
            assert run(["make", "-n", words[1]], ROOT).returncode == 0, (
                f"{where}: `{m.group(1)}`: no make target"
            )
        elif words[0] == "python" and words[1].startswith("benchmarks/"):
            script = ROOT / words[1]
            assert script.is_file(), f"{where}: `{m.group(1)}`: {script} is missing"
            if str(script) not in helps:
                r = run([sys.executable, str(script), "--help"], ROOT, timeout=120)
                assert r.returncode == 0, f"{script} --help: {r.stderr[-1500:]}"
                assert "usage" in r.stdout.lower(), f"{script} has no --help (it may have run instead)"
                helps[str(script)] = r.stdout
            suite = [words[2]] if len(words) > 2 and re.fullmatch(r"[a-z][a-z_0-9]*", words[2]) else []
            for name in suite + [w.split("=")[0] for w in words[2:] if w.startswith("--")]:
                assert name in helps[str(script)], (
                    f"{where}: `{m.group(1)}`: {name!r} not in {script.name} --help"
                )
