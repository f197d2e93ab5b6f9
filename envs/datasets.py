"""Your own data: rows from the files users have, a field mapping, and a held-out part that stays out.

**Formats** (:func:`load_rows`): a ``.jsonl`` file (one JSON object a line), a ``.json`` file (a list
of objects), a ``.csv`` file (a header line; every value a string), a ``.parquet`` file, a folder
written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, of which ``split``
is read), or a Hugging Face Hub dataset id such as ``openai/gsm8k`` (read by ``datasets.load_dataset``
through its own cache, so ``HF_HUB_OFFLINE=1`` with a filled cache works without a network). Parquet,
folders and Hub ids need the ``datasets`` and ``pyarrow`` packages (the ``train`` extra).

**Field mapping** (:class:`FieldMap`): ``question_key`` and ``answer_key`` name the row's fields,
and ``answer_extract`` reads the gold answer out of a longer text: ``last_boxed`` takes the last
``\\boxed{...}`` (MATH's ``solution``), ``after_hashes`` the text after the last ``####`` (GSM8K's
``answer``). A row without a field raises ``ValueError`` naming the file, the row and the field.

**Held-out part** (:func:`split_rows`). A dataset-backed environment takes ``part``:

* ``"train"`` (the default): the rows training may see;
* ``"heldout"``: the others, which the in-distribution evaluation (split ``id``) uses;
* ``"all"``: every row (an explicit test file given as its own evaluation split).

With ``heldout_data`` (a second file) the held-out part is that file, and the training part is
``data`` minus every row whose question also appears in it. Otherwise the distinct questions are
ordered by the SHA-256 of their text and the first ``heldout_fraction`` of them (rounded, at least
one) are held out, with every row that repeats one of them: the split depends on the questions
only, not on row order, file format or seeds, and no question is on both sides. The training
configuration (:class:`~veriloop.configs.env.EnvConfig`) gives training ``part: train`` and the
``id`` evaluation ``part: heldout`` for every environment class with ``heldout_parts = True``.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from veriloop.envs.base import VerifierEnv
from veriloop.envs.json_safe import json_safe
from veriloop.envs.verifiers import Verdict
from veriloop.envs.verifiers.extract import last_boxed
from veriloop.envs.verifiers.screen import is_non_finite

Part = Literal["train", "heldout", "all"]
PARTS: tuple[Part, ...] = ("train", "heldout", "all")
DEFAULT_HELDOUT_FRACTION = 0.2
Extract = Literal["last_boxed", "after_hashes"]
EXTRACTORS: tuple[Extract, ...] = ("last_boxed", "after_hashes")
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")

#: A CSV field longer than this is refused (``csv``'s own limit; an unclosed quote reads the rest of the file).
MAX_CSV_FIELD_CHARS = csv.field_size_limit()
#: A question or gold answer longer than this is refused: no model's context holds such a prompt.
MAX_FIELD_CHARS = 100_000
_SURROGATE = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as ``surrogateescape`` reads it

#: One row and where it came from (``file:line`` or ``file row N``), for error messages.
Row = tuple[str, dict[str, Any]]


# ---------------------------------------------------------------------------- loading
def load_rows(
    source: str | Path, *, split: str = "train", revision: str | None = None, subset: str | None = None
) -> list[Row]:
    """Every row of ``source`` as ``(where, dict)``; see the module docstring for the formats.

    ``split`` picks the split of a ``DatasetDict`` folder or a Hub dataset; ``revision`` a Hub
    dataset's branch, tag or commit; ``subset`` a Hub dataset's subset (config name, e.g. GSM8K's
    ``main``). Raises ``FileNotFoundError`` (what was tried) or ``ValueError``
    (``where: reason``) before any row is used.
    """
    path = Path(str(source)).expanduser()
    if path.is_dir():
        rows = _rows_from_folder(path, split)
    elif path.is_file():
        rows = _rows_from_file(path)
    elif _looks_like_hub_id(str(source)):
        rows = _rows_from_hub(str(source), split, revision, subset)
    else:
        raise FileNotFoundError(
            f"dataset {str(source)!r} not found: it is not a file, not a folder and not a Hub dataset id "
            f"(owner/name). Give a {'/'.join(FILE_SUFFIXES)} file, a datasets.save_to_disk folder or a Hub id"
        )
    if not rows:
        raise ValueError(f"{source}: no rows found (the dataset is empty)")
    return rows


def _looks_like_hub_id(text: str) -> bool:
    """``owner/name`` without a data-file suffix (``mine.parquet`` that is missing is a missing file)."""
    return bool(re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", text)) and not text.lower().endswith(FILE_SUFFIXES)


def _rows_from_file(path: Path) -> list[Row]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return list(jsonl_rows(path))
    if suffix == ".json":
        return _json_rows(path)
    if suffix == ".csv":
        return csv_rows(path)
    if suffix == ".parquet":
        pq = _require("pyarrow.parquet", "pyarrow")
        table = pq.read_table(path)
        return [(f"{path} row {i}", r) for i, r in enumerate(table.to_pylist(), start=1)]
    raise ValueError(f"{path}: unknown data format {suffix or '(no suffix)'!r}; use one of {FILE_SUFFIXES}")


def jsonl_rows(path: Path) -> Iterator[Row]:
    """``(where, row)`` for every non-blank line of a JSONL file, ``where`` = ``path:line``.

    Raises:
        ValueError: naming the file and line: not UTF-8, not JSON, or not a JSON object.
    """
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise ValueError(f"{where}: invalid JSON (nested too deeply)") from None
            yield where, _as_dict(row, where)


def csv_rows(path: Path) -> list[Row]:
    """``(where, row)`` for every record of a CSV file with a header line, ``where`` = ``path row N``.

    Raises:
        ValueError: naming the file, the row and its line: a field that is not UTF-8 text, or one
            longer than :data:`MAX_CSV_FIELD_CHARS` (a broken quote swallows the rest of the file so).
    """
    rows: list[Row] = []
    with path.open(newline="", encoding="utf-8", errors="surrogateescape") as handle:
        reader = csv.DictReader(handle)
        while True:
            where = f"{path} row {len(rows) + 1}"
            try:
                row = next(reader, None)
            except csv.Error as exc:
                raise ValueError(
                    f"{where}: unreadable CSV ({exc}; at most {MAX_CSV_FIELD_CHARS:,} "
                    "characters a field: look for an unclosed quote)"
                ) from None
            if row is None:
                return rows
            for key, value in row.items():
                for text in (key, *(value if isinstance(value, list) else [value])):
                    if isinstance(text, str) and _SURROGATE.search(text):
                        raise ValueError(
                            f"{where} (line {reader.line_num}): field {key!r:.40} is not UTF-8 text: "
                            "save the file as UTF-8"
                        )
            rows.append((where, dict(row)))


def _json_rows(path: Path) -> list[Row]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    if isinstance(data, Mapping) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} or {"train": [...]}
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    return [(f"{path} row {i}", _as_dict(r, f"{path} row {i}")) for i, r in enumerate(data, start=1)]


def _as_dict(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return dict(row)


def _rows_from_folder(path: Path, split: str) -> list[Row]:
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise ValueError(
            f"{path} is a folder but not one written by datasets' save_to_disk (no dataset_info.json or "
            "dataset_dict.json in it); give a data file or such a folder"
        )
    datasets = _require("datasets", "datasets")
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path}: no split {split!r}; it has {sorted(data)}: set split to one of them")
        data = data[split]
    return [(f"{path} row {i}", dict(r)) for i, r in enumerate(data, start=1)]


def _rows_from_hub(dataset_id: str, split: str, revision: str | None, subset: str | None) -> list[Row]:
    """A Hub dataset's ``split`` (of ``subset``, the Hub's config name) through ``datasets.load_dataset``
    and its cache; offline (``HF_HUB_OFFLINE=1``) without that cache, from the data files in the
    Hub cache (``huggingface_hub``'s layout, what any download leaves)."""
    datasets = _require("datasets", "datasets")
    hub = _require("huggingface_hub", "huggingface_hub")
    try:
        data = datasets.load_dataset(dataset_id, subset, split=split, revision=revision)
        return [(f"{dataset_id}[{split}] row {i}", dict(r)) for i, r in enumerate(data, start=1)]
    except Exception as exc:  # unknown id, missing subset, no network: its own message says which
        if not hub.constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(_hub_help(dataset_id, revision, f"{type(exc).__name__}: {exc}")) from None
    try:
        folder = Path(
            hub.snapshot_download(
                dataset_id,
                repo_type="dataset",
                revision=revision,
                allow_patterns=[f"*{s}" for s in FILE_SUFFIXES],
            )
        )
    except Exception as exc:
        raise FileNotFoundError(_hub_help(dataset_id, revision, f"{type(exc).__name__}: {exc}")) from None
    files = [
        p
        for p in sorted(folder.rglob("*"))
        if p.suffix.lower() in FILE_SUFFIXES and _in_split(p, folder, split)
    ]
    subsets = sorted(
        {p.relative_to(folder).parts[0] for p in files if len(p.relative_to(folder).parts) > 1} - {"data"}
    )
    if subset is not None:
        files = [p for p in files if subset in p.relative_to(folder).parts[:-1]]
    elif len(subsets) > 1:
        raise ValueError(f"Hub dataset {dataset_id!r} has subsets {subsets}: set subset to one of them")
    if not files:
        found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        raise FileNotFoundError(
            f"Hub dataset {dataset_id!r} has no data file for split {split!r}"
            + (f" of subset {subset!r}" if subset else "")
            + f" (files: {found[:10]}); set split (or subset)"
        )
    return [row for path in files for row in _rows_from_file(path)]


def _hub_help(dataset_id: str, revision: str | None, why: str) -> str:
    return (
        f"dataset {dataset_id!r} is not a local file or folder, and as a Hugging Face Hub dataset (revision "
        f"{revision or 'main'}) it could not be loaded: {why}. Check the id (and subset); with "
        f"HF_HUB_OFFLINE=1 it must have been downloaded once (online, or `hf download {dataset_id} "
        "--repo-type dataset`); or save it to a file and pass its path"
    )


def _in_split(path: Path, root: Path, split: str) -> bool:
    """The Hub's naming: ``data/train-00000-of-00001.parquet``, ``train.jsonl`` or ``train/x.parquet``."""
    rel = path.relative_to(root)
    return split in rel.parts[:-1] or path.stem == split or path.name.startswith(f"{split}-")


def _require(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"reading this dataset needs the package {package!r}: pip install 'veriloop[train]' "
            f"(or pip install {package})"
        ) from None


# ---------------------------------------------------------------------------- field mapping
@dataclass(frozen=True)
class FieldMap:
    """Which fields of a row hold the question and the gold answer.

    Attributes:
        question_key: The question's field (``question``; MATH calls it ``problem``).
        answer_key: The gold answer's field (``answer``; ``solution`` with ``answer_extract``).
        answer_extract: ``None`` (the field is the answer), ``"last_boxed"`` (the last
            ``\\boxed{...}`` in it) or ``"after_hashes"`` (the text after its last ``####``).
    """

    question_key: str = "question"
    answer_key: str = "answer"
    answer_extract: Extract | None = None

    def __post_init__(self) -> None:
        if self.answer_extract is not None and self.answer_extract not in EXTRACTORS:
            raise ValueError(
                f"answer_extract must be None or one of {EXTRACTORS}, got {self.answer_extract!r}"
            )

    def question(self, row: Mapping[str, Any], where: str) -> str:
        value = self._field(row, self.question_key, "question_key", where)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(
                f"{where}: field {self.question_key!r} must be a non-empty string, got {value!r:.60}"
            )
        refuse_oversized(value, self.question_key, where)
        return value

    def answer(self, row: Mapping[str, Any], where: str) -> str:
        value = self._field(row, self.answer_key, "answer_key", where)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(
                f"{where}: field {self.answer_key!r} must be a string or number, got {type(value).__name__}"
            )
        refuse_non_finite(value, self.answer_key, where)
        text = str(value).strip()
        refuse_oversized(text, self.answer_key, where)
        if self.answer_extract == "last_boxed":
            span = last_boxed(text)
            if span is None:
                raise ValueError(
                    f"{where}: field {self.answer_key!r} has no complete \\boxed{{...}} to take the answer from"
                )
            text = text[span[1] : span[2]].strip()
        elif self.answer_extract == "after_hashes":
            if "####" not in text:
                raise ValueError(f"{where}: field {self.answer_key!r} has no '####' before its final answer")
            text = text.rsplit("####", 1)[1].strip()
        if not text:
            raise ValueError(f"{where}: the gold answer (field {self.answer_key!r}) is empty")
        refuse_non_finite(text, self.answer_key, where)
        return text

    @staticmethod
    def _field(row: Mapping[str, Any], key: str, setting: str, where: str) -> Any:
        if key not in row or row[key] is None:
            raise ValueError(
                f"{where}: missing field {key!r} (the {setting}); the row has {sorted(row)}: set {setting} "
                "to the field that holds it"
            )
        return row[key]


def refuse_oversized(text: str, key: str, where: str) -> None:
    """``ValueError`` naming ``where`` and ``key`` when ``text`` is over :data:`MAX_FIELD_CHARS`."""
    if len(text) > MAX_FIELD_CHARS:
        raise ValueError(
            f"{where}: field {key!r} is {len(text):,} characters, over the limit of {MAX_FIELD_CHARS:,} "
            "(no model's context holds it): shorten or drop the row"
        )


def refuse_non_finite(value: Any, key: str, where: str) -> None:
    """``ValueError`` naming ``where`` and ``key`` when a gold is NaN or infinite, or text spelling one
    (``nan``, ``inf``): pandas writes a missing float as NaN, and math-verify would pay ``\\boxed{nan}``."""
    if is_non_finite(value):
        raise ValueError(
            f"{where}: field {key!r} is {str(value).strip()!r:.20}, not a gold answer (a missing or "
            "overflowed number, as pandas writes a missing float): fix or drop the row"
        )


# ---------------------------------------------------------------------------- held-out part
def question_digest(question: str) -> str:
    """The SHA-256 of a question with its whitespace collapsed: the key the split orders by."""
    return hashlib.sha256(" ".join(question.split()).encode("utf-8")).hexdigest()


def split_rows(questions: Sequence[str], part: Part, heldout_fraction: float) -> list[int]:
    """Indices of the rows in ``part`` (see the module docstring; ``heldout`` and ``train`` partition
    the rows, and rows that share a question are always on the same side)."""
    check_part(part, heldout_fraction)
    if part == "all":
        return list(range(len(questions)))
    digests = [question_digest(q) for q in questions]
    distinct = sorted(set(digests))
    if len(distinct) < 2:
        raise ValueError(
            f"{len(distinct)} distinct question(s): a held-out part needs at least 2; add rows, or give "
            "heldout_data (a separate file) and use part: all for a file with a single question"
        )
    n_held = min(len(distinct) - 1, max(1, round(heldout_fraction * len(distinct))))
    held = set(distinct[:n_held])
    return [i for i, d in enumerate(digests) if (d in held) == (part == "heldout")]


def check_part(part: str, heldout_fraction: float) -> None:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")


def select_part(
    rows: Sequence[Any],
    questions: Sequence[str],
    *,
    part: Part,
    heldout_fraction: float,
    heldout_questions: Sequence[str] | None = None,
) -> list[Any]:
    """The rows of ``part``; with ``heldout_questions`` (the rows of ``heldout_data``) training
    keeps the rows whose question is not among them."""
    check_part(part, heldout_fraction)
    if heldout_questions is None:
        return [rows[i] for i in split_rows(questions, part, heldout_fraction)]
    if part == "heldout":
        raise ValueError("select_part: with heldout_data the held-out part is that file's rows")
    if part == "all":
        return list(rows)
    held = {question_digest(q) for q in heldout_questions}
    return [r for r, q in zip(rows, questions, strict=True) if question_digest(q) not in held]


def index_range(size: int, part: Part, heldout_fraction: float) -> range:
    """The item indices of ``part`` for a generated dataset of ``size`` items: the last
    ``heldout_fraction`` of ``[0, size)`` (rounded, at least one) are held out."""
    check_part(part, heldout_fraction)
    if part == "all":
        return range(size)
    if size < 2:
        raise ValueError(f"{size} item(s): a held-out part needs at least 2 (raise the dataset's size)")
    n_held = min(size - 1, max(1, round(heldout_fraction * size)))
    return range(size - n_held, size) if part == "heldout" else range(size - n_held)


def describe_part(name: str, part: Part, kept: int, total: int, fraction: float, heldout: str | None) -> str:
    """One line for reports: which rows of which data an environment uses."""
    if part == "all":
        return f"all {total} rows of {name}"
    if heldout is not None and part == "heldout":
        return f"all {kept} rows of the held-out file {heldout}"
    if heldout is not None:
        return (
            f"{kept} of {total} rows of {name} (those whose question is not in the held-out file {heldout})"
        )
    side = "held-out" if part == "heldout" else "training"
    return f"{kept} {side} rows of {total} in {name} (heldout_fraction {fraction:g}, split by question hash)"


# ---------------------------------------------------------------------------- config plumbing
def holds_out(env_id: str) -> bool:
    """Whether ``env_id``'s class splits its rows into parts (``heldout_parts = True``)."""
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    try:
        entry = gymnasium.spec(env_id).entry_point
        creator = load_env_creator(entry) if isinstance(entry, str) else entry
    except Exception:  # an unknown id or a module that fails: resolve() reports those
        return False
    return bool(getattr(creator, "heldout_parts", False))


def with_part(env_id: str, kwargs: Mapping[str, Any], part: Part) -> dict[str, Any]:
    """``kwargs`` with ``part`` set when the environment holds rows out (a ``part`` given is kept)."""
    out = dict(kwargs)
    if "part" not in out and holds_out(env_id):
        out["part"] = part
    return out


def source_key(env_id: str, kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """What rows an environment reads: its ``data``, else its id with its ``dataset`` and ``config``
    (a generated dataset such as reasoning-gym's); two envs with the same key share rows. None for
    an env with neither (a generator, kept apart by seeds)."""
    if kwargs.get("data") is not None:
        return ("data", str(kwargs["data"]))
    if kwargs.get("dataset") is None:
        return None
    return (env_id, json.dumps([kwargs.get("dataset"), kwargs.get("config")], sort_keys=True, default=str))


def heldout_kwargs(env_id: str, train_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``id`` evaluation's kwargs of a training env: its held-out part (``ValueError`` when the
    training kwargs ask for another part than ``train``: the evaluation would see training rows)."""
    if not holds_out(env_id):
        return dict(train_kwargs)
    if train_kwargs.get("part", "train") != "train":
        raise ValueError(
            f"{env_id}: training with part {train_kwargs['part']!r} would put held-out rows in training; "
            "leave part unset (training reads part train, the id evaluation part heldout)"
        )
    return {**train_kwargs, "part": "heldout"}


# ---------------------------------------------------------------------------- dataset + check function
CheckFn = Callable[[str, str], "Verdict | bool"]


def resolve_check(check: CheckFn | str) -> CheckFn:
    """A check function, or ``"module:function"`` imported (the working directory is importable)."""
    if callable(check):
        return check
    if not isinstance(check, str) or ":" not in check:
        raise ValueError(f"check must be a function or 'module:function', got {check!r}")
    import sys

    module_name, _, attr = check.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"check {check!r}: cannot import it ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"check {check!r} is not a function")
    return fn  # type: ignore[no-any-return]


class DatasetEnv(VerifierEnv[dict]):
    """The rows of a dataset, answered and judged by your function (see :func:`register_dataset_env`).

    Args:
        data: A dataset (see :func:`load_rows`).
        check: ``check(response, answer) -> bool | Verdict``, or ``"module:function"``. It is your
            code and runs in this process; an exception in it is a verifier failure
            (``Verdict.error == "crash"``), never a wrong answer.
        question_key, answer_key, answer_extract: See :class:`FieldMap`.
        prompt: The prompt, with ``{question}`` (and any other field of the row) filled in.
        part, heldout_fraction, heldout_data: Which rows (see the module docstring).
        split, revision, subset: Of a ``DatasetDict`` folder or a Hub dataset (see :func:`load_rows`).
        max_attempts: Responses per episode (retries see "Incorrect").

    Reward 1 for a correct response, else 0 (``{"accuracy": 0|1}``). ``info["task"]`` is the row
    with ``question`` and ``answer`` (the gold, not for the policy) filled in.
    """

    heldout_parts: ClassVar[bool] = True

    def __init__(
        self,
        *,
        data: str | Path,
        check: CheckFn | str,
        question_key: str = "question",
        answer_key: str = "answer",
        answer_extract: Extract | None = None,
        prompt: str = "{question}",
        part: Part = "train",
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
        heldout_data: str | Path | None = None,
        split: str = "train",
        revision: str | None = None,
        subset: str | None = None,
        max_attempts: int = 1,
        **base_kwargs: Any,
    ) -> None:
        super().__init__(max_attempts=max_attempts, **base_kwargs)
        self._check = resolve_check(check)
        fields = FieldMap(question_key, answer_key, answer_extract)
        self.prompt_template = prompt
        tasks = _tasks(load_rows(data, split=split, revision=revision, subset=subset), fields)
        held = None if heldout_data is None else _tasks(load_rows(heldout_data), fields)
        if part == "heldout" and held is not None:
            self.tasks = held
        else:
            questions = [t["question"] for t in tasks]
            held_q = None if held is None else [t["question"] for t in held]
            self.tasks = select_part(
                tasks, questions, part=part, heldout_fraction=heldout_fraction, heldout_questions=held_q
            )
        if not self.tasks:
            raise ValueError(f"{data}: the {part} part is empty")
        self.part_source = describe_part(
            str(data),
            part,
            len(self.tasks),
            len(tasks),
            heldout_fraction,
            None if heldout_data is None else str(heldout_data),
        )
        self.prompt(self.tasks[0])  # a template naming a missing field fails here, not mid-run

    def sample_task(self) -> dict:
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def prompt(self, task: dict) -> str:
        try:
            return self.prompt_template.format(**task)
        except (KeyError, IndexError) as exc:
            raise ValueError(
                f"prompt {self.prompt_template!r} names {exc}, which the row lacks ({sorted(task)})"
            ) from None

    def check(self, response: str, task: dict) -> Verdict:
        try:
            out = self._check(response, task["answer"])
        except Exception as exc:  # the user's function failed: a verifier failure, not a wrong answer
            return Verdict(
                correct=False,
                error="crash",
                reason="verifier_error",
                feedback="The checker failed.",
                details={"exception": f"{type(exc).__name__}: {exc}"[:500]},
            )
        if isinstance(out, Verdict):
            return out
        if not isinstance(out, bool):
            return Verdict(
                correct=False,
                error="crash",
                reason="verifier_error",
                details={"exception": f"check returned {type(out).__name__}, not bool or Verdict"},
            )
        return Verdict(
            correct=out,
            reason="correct" if out else "wrong_value",
            feedback="Correct." if out else "Incorrect.",
        )

    def reward(self, verdict: Verdict, task: dict) -> tuple[float, dict[str, float]]:
        r = 1.0 if verdict.correct else 0.0
        return r, {"accuracy": r}

    def task_from_options(self, spec: Any) -> dict:
        if not isinstance(spec, Mapping) or "question" not in spec or "answer" not in spec:
            raise TypeError('options["task"] must be a dict with "question" and "answer"')
        return dict(spec)


def register_dataset_env(env_id: str, *, data: str | Path, check: CheckFn | str, **kwargs: Any) -> None:
    """Register ``env_id`` as a :class:`DatasetEnv` of ``data`` judged by ``check`` (other
    :class:`DatasetEnv` arguments as ``kwargs``); put the call in a module and train with
    ``veriloop train CONFIG env.id=module:env_id``. Configs may still override any argument."""
    import gymnasium

    gymnasium.register(
        env_id, entry_point=cast(Any, DatasetEnv), kwargs={"data": str(data), "check": check, **kwargs}
    )


def _tasks(rows: Sequence[Row], fields: FieldMap) -> list[dict[str, Any]]:
    out = []
    for where, row in rows:
        task = {k: json_safe(v) for k, v in row.items()}
        task["question"], task["answer"] = fields.question(row, where), fields.answer(row, where)
        out.append(task)
    return out
