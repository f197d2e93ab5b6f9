"""``veriloop serve-vllm``: start a vLLM generation server for ``rollout.backend: vllm_server``.

It runs vLLM's OpenAI-compatible server with the flags the server backend relies on
(:func:`veriloop.agents.backends.vllm_server.serve_command` says which and why); ``--print`` shows
the command line and environment instead, to run by hand or in a job script on another machine.

:func:`running_server` starts one in the background from Python (a script, a benchmark, a test) and
stops it, with every process it started, when its block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def add_serve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``veriloop serve-vllm [--model M] [--port P] [--lora-rank R] [--print] [-- VLLM_ARGS...]``."""
    p = sub.add_parser("serve-vllm", help="start a vLLM server for rollout.backend=vllm_server (needs vllm)")
    p.add_argument(
        "--model", default="default", help="base model folder or Hub id ('default': the cached SmolLM2)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other nodes)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="weights dtype; the trainer's own (float32) avoids a "
        "sampler/trainer mismatch, bfloat16 samples faster (default float32)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="serve LoRA adapters up to this rank (lora_sync=adapter); 0 = off (full weights)",
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="longest context in tokens (default 2048)")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size in GiB (default: 1 on CPU, vLLM's own share of GPU memory on GPUs)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="settings for vLLM's CPU build or a GPU build (auto: cpu without CUDA)",
    )
    p.add_argument("--print", action="store_true", help="print the command and environment; start nothing")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARG", help="more vLLM server flags, after --")
    p.set_defaults(handler=cmd_serve_vllm)


def cmd_serve_vllm(args: argparse.Namespace) -> int:
    from veriloop.agents.backends.vllm_server import serve_command

    model = args.model
    if model == "default":
        from veriloop.agents.models import text as default_model

        model = str(default_model.default_model_path())
    elif model == "gemma3-270m":
        from veriloop.agents.models.gemma import gemma_model_path

        model = str(gemma_model_path())
    argv, env = serve_command(
        model,
        port=args.port,
        host=args.host,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        cpu=_on_cpu(args.device),
        python=sys.executable,
        extra=args.vllm_args,
    )
    env = {k: v for k, v in env.items() if k not in os.environ}  # the caller's own settings win
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        return 0
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(
            "veriloop serve-vllm: vllm is not installed here; `make setup-vllm` (CPU) or "
            "`pip install veriloop[vllm]` (GPU), then run .venv-vllm/bin/veriloop serve-vllm",
            file=sys.stderr,
        )
        return 2
    print(f"serving {model} at http://{args.host}:{args.port} (ready when GET /health answers)", flush=True)
    os.execve(argv[0], argv, {**os.environ, **env})


def _on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


@dataclass(frozen=True)
class RunningServer:
    """A ``veriloop serve-vllm`` process started by :func:`running_server`: its base URL and process."""

    url: str
    proc: subprocess.Popen


@contextlib.contextmanager
def running_server(
    *args: str, log: Path, port: int | None = None, ready_s: float = 600.0, python: str = sys.executable
) -> Iterator[RunningServer]:
    """``veriloop serve-vllm --port P ARGS`` in its own session (``port``: a free one when None), its
    output in ``log``; yields once ``GET /health`` answers, and stops the server and every process it
    started when the block ends. A server that exits or does not answer within ``ready_s`` seconds is
    a RuntimeError with the end of its log."""
    port = free_port() if port is None else port
    # the server runs its engine in a process of its own: the trainer-side setting is not for it
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [python, "-m", "veriloop.cli", "serve-vllm", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() - t0 > ready_s:
                why = (
                    "exited" if proc.poll() is not None else f"did not answer GET /health in {ready_s:.0f} s"
                )
                raise RuntimeError(f"the vLLM server {why} (log: {log}):\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield RunningServer(url, proc)
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a server started in its own session and every process it started, then wait for it
    (``SIGKILL`` after 60 s, and for any child the engine left behind)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def healthy(url: str) -> bool:
    """Whether ``GET url/health`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
