"""vLLM backend, checked against the HF path.

Two parts:

* **Real vLLM** (``make test-vllm``: vLLM's CPU build in ``.venv-vllm``, the default model in fp32).
  Every sample is checked against a fresh HF forward pass of the same policy: recorded log-probs
  within ``ATOL`` (measured ~3e-5 in fp32; the HF path's own tests use 2e-4), token ids verbatim in
  and out, the same greedy tokens, stop strings and ``max_tokens`` as the HF backend, weight sync
  after an optimizer step (full fine-tuning, LoRA merged into full weights, LoRA served as an
  adapter), and the ``Trajectory`` invariants of multi-turn math and Points24 episodes. Without
  vllm these tests skip, unless ``VERILOOP_REQUIRE_VLLM=1`` (set by ``make test-vllm``) makes the
  missing package a failure.
* **A stand-in** for the parts of vLLM's API the backend calls (runs everywhere): how calls and
  results are mapped.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import time
import types
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from veriloop.agents.backends import GenRequest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
#: Recorded vs recomputed log-prob, per token (fp32 on both sides).
ATOL = 1e-4

requires_vllm = pytest.mark.skipif(
    not HAS_VLLM and os.environ.get("VERILOOP_REQUIRE_VLLM") != "1",
    reason="needs vLLM: `make setup-vllm`, then `make test-vllm`",
)


# ------------------------------------------------------------------------------------------ real vLLM


@pytest.fixture(scope="module")
def engines():
    """One live engine at a time (two in one process would hold two models and KV caches).

    ``get(kind)`` builds (or returns) the engine of that kind and shuts any other down first:
    ``"plain"`` serves full weights (full fine-tuning and merged LoRA), ``"adapter"`` serves
    ``LoRARequest`` s (eager mode: it is the GPU path, tested here for correctness only).
    """
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.loading import LoraSettings, load_policy

    live: dict[str, VLLMBackend] = {}

    def get(kind: str) -> Any:
        if kind in live:
            return live[kind].llm
        for other in list(live):
            live.pop(other).close()
        if kind == "plain":
            live[kind] = VLLMBackend(load_policy("default"), max_model_len=2048)
        else:
            policy = load_policy("default", lora=LoraSettings(r=8, alpha=16))
            live[kind] = VLLMBackend(policy, lora_sync="adapter", max_model_len=2048, enforce_eager=True)
        return live[kind].llm

    yield get
    for backend in live.values():
        backend.close()


@pytest.fixture(scope="module")
def base_policy():
    from veriloop.agents.loading import load_policy

    return load_policy("default")


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_logprobs(policy, context: list[int], sampled: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(sampled)] log-probs of ``sampled`` after ``context`` from a fresh HF forward pass."""
    from veriloop.agents.forward import token_logprobs

    ids = torch.tensor([context + sampled])
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids), temperature=temperature)
    return lp[0, len(context) :]


def assert_matches_hf(policy, context, results, temperature=1.0):
    for r in results:
        fresh = hf_logprobs(policy, context, r.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), fresh, atol=ATOL, rtol=0)


def sample(backend, context, n=4, max_new=24, seed=0, **kw):
    from veriloop.agents.sampling_params import SamplingParams

    reqs = [GenRequest(i, context, max_new) for i in range(n)]
    return backend.generate(
        reqs, SamplingParams(max_new_tokens=max_new, **kw), torch.Generator().manual_seed(seed)
    )


def sft_step(policy, context, results, lr):
    """One AdamW step raising the log-prob of ``results`` (a stand-in for any training update)."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.model.train()
    loss = torch.stack([-hf_logprobs_grad(policy, context, r.token_ids).mean() for r in results]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    policy.model.eval()


def hf_logprobs_grad(policy, context, sampled):
    from veriloop.agents.forward import token_logprobs

    ids = torch.tensor([context + sampled])
    lp, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))
    return lp[0, len(context) :]


@requires_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_ids_pass_through_and_logprobs_match_hf(engines, base_policy, temperature):
    from veriloop.agents.backends import eos_token_ids
    from veriloop.agents.backends.vllm import VLLMBackend

    backend = VLLMBackend(base_policy, llm=engines("plain"))
    tok = base_policy.tokenizer
    # a context no tokenizer would produce ("hello" spelled one character per token): if vLLM
    # re-tokenized it, the log-probs below would not match the HF forward on these exact ids
    head = chat_ids(tok, "Say something about ")
    cut = len(head) - 5  # before "<|im_end|>\n<|im_start|>assistant\n"
    context = head[:cut] + [tok.convert_tokens_to_ids(c) for c in "hello"] + head[cut:]
    assert tok(tok.decode(context), add_special_tokens=False)["input_ids"] != context
    out = sample(backend, context, n=4, max_new=24, seed=1, temperature=temperature)
    eos = set(eos_token_ids(tok, base_policy.model))
    for r in out:
        assert len(r.token_ids) == len(r.logprobs) and all(lp <= 0 for lp in r.logprobs)
        if r.finish == "eos":  # the end-of-turn id is kept, as the HF backend keeps it
            assert r.token_ids[-1] in eos and not eos & set(r.token_ids[:-1])
        else:
            assert r.finish == "length" and len(r.token_ids) == 24 and not eos & set(r.token_ids)
    assert_matches_hf(base_policy, context, out, temperature)


@requires_vllm
def test_greedy_tokens_max_tokens_and_stop_strings_as_in_hf(engines, base_policy):
    from veriloop.agents.backends.hf import HFBackend
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.sampling_params import SamplingParams

    backend, hf = VLLMBackend(base_policy, llm=engines("plain")), HFBackend(base_policy)
    context = chat_ids(base_policy.tokenizer, "List three fruits.")
    g = torch.Generator()

    def both(params, max_new):
        reqs = [GenRequest("a", context, max_new)]
        return backend.generate(reqs, params, g)[0], hf.generate(reqs, params, g)[0]

    v, h = both(SamplingParams.greedy(max_new_tokens=12), 12)
    assert (v.token_ids, v.finish) == (h.token_ids, h.finish) and v.finish == "length"
    torch.testing.assert_close(torch.tensor(v.logprobs), torch.tensor(h.logprobs), atol=ATOL, rtol=0)
    stop = base_policy.tokenizer.decode(v.token_ids[4:5]).strip() or "\n"
    v2, h2 = both(SamplingParams.greedy(max_new_tokens=12, stop=(stop,)), 12)
    assert v2.finish == h2.finish == "stop"
    assert v2.token_ids == h2.token_ids and len(v2.token_ids) <= 5  # the completing token is kept


@requires_vllm
def test_a_fixed_seed_reproduces_the_tokens(engines, base_policy):
    from veriloop.agents.backends.vllm import VLLMBackend

    backend = VLLMBackend(base_policy, llm=engines("plain"))
    context = chat_ids(base_policy.tokenizer, "Tell me a story.")
    first, again, other = (sample(backend, context, n=4, seed=s) for s in (3, 3, 4))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


@requires_vllm
def test_prompts_beyond_the_token_budget_are_seeded_and_reproducible(engines, base_policy):
    """8 x ~700-token contexts exceed one step's token budget (4096): with chunked prefill, vLLM's
    CPU build crashed here ("CPU Generator does not use offset"); the backend turns it off."""
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.sampling_params import SamplingParams

    backend = VLLMBackend(base_policy, llm=engines("plain"))
    texts = [f"Story {i}. Summarise it: " + f"the cat number {i} sat on the mat. " * 70 for i in range(8)]
    reqs = [GenRequest(i, chat_ids(base_policy.tokenizer, t), 4) for i, t in enumerate(texts)]
    assert sum(len(r.context_ids) for r in reqs) > 5000  # distinct prompts: no prefix-cache hits

    def run():
        return backend.generate(reqs, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(2))

    assert [r.token_ids for r in run()] == [r.token_ids for r in run()]


@requires_vllm
def test_full_finetuning_step_is_served(engines):
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.loading import load_policy

    policy = load_policy("default")
    backend = VLLMBackend(policy, llm=engines("plain"))
    context = chat_ids(policy.tokenizer, "What is 7 times 8?")
    before = sample(backend, context, seed=5)
    old = copy.deepcopy(policy.model)
    sft_step(policy, context, before, lr=1e-4)
    t0 = time.perf_counter()
    backend.sync()
    print(f"full-weight sync: {time.perf_counter() - t0:.2f} s")
    after = sample(backend, context, seed=5)
    assert_matches_hf(policy, context, after)  # the updated policy is served...
    moved = max(
        float(
            (hf_logprobs(types.SimpleNamespace(model=old), context, r.token_ids) - torch.tensor(r.logprobs))
            .abs()
            .max()
        )
        for r in after
    )
    assert moved > 10 * ATOL  # ...and the update is large enough that serving the old one would show


@requires_vllm
def test_lora_merged_into_full_weights_serves_each_update(engines, base_policy):
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.loading import LoraSettings, load_policy

    policy = load_policy("default", lora=LoraSettings(r=8, alpha=16))
    backend = VLLMBackend(policy, llm=engines("plain"), lora_sync="merge")
    assert not backend.serves_adapter
    context = chat_ids(policy.tokenizer, "What is 7 times 8?")
    before = sample(backend, context, seed=6)
    base = VLLMBackend(base_policy, llm=engines("plain"))  # B = 0: the adapter changes nothing yet
    assert [r.token_ids for r in sample(base, context, seed=6)] == [r.token_ids for r in before]
    backend.sync()  # the LoRA policy's weights again
    weights = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    sft_step(policy, context, before, lr=2e-3)
    t0 = time.perf_counter()
    backend.sync()
    print(f"LoRA merge + reload sync: {time.perf_counter() - t0:.2f} s")
    changed = [n for n, p in policy.model.named_parameters() if not torch.equal(p, weights[n])]
    assert changed and all("lora_" in n for n in changed)  # merging never touched the base weights
    after = sample(backend, context, seed=6)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]  # same seed, new policy
    assert_matches_hf(policy, context, after)


@requires_vllm
@pytest.mark.parametrize(
    "env_id,kwargs",
    [
        ("veriloop/MathVerify-v0", {"level": 1, "max_attempts": 2}),
        ("veriloop/Points24-text-v0", {"max_attempts": 2}),
    ],
)
def test_multi_turn_episodes_keep_the_trajectory_invariants(engines, base_policy, env_id, kwargs):
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.engine import RolloutLimits, grouped_specs, rollout
    from veriloop.agents.sampling_params import SamplingParams

    backend = VLLMBackend(base_policy, llm=engines("plain"))
    specs = grouped_specs(env_id, kwargs, seeds=[0, 1, 2], group_size=2)
    limits = RolloutLimits(max_new_tokens=48, max_turns=2, max_context=1024)
    trajs = rollout(
        base_policy, specs, sampling=SamplingParams(max_new_tokens=48, seed=0), limits=limits, backend=backend
    )
    eos = base_policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for tr in trajs:
        n = len(tr.token_ids)
        assert len(tr.loss_mask) == len(tr.logprobs) == len(tr.turn_index) == n
        spans = [(t.start, t.end) for t in tr.turns]
        assert [i for i, m in enumerate(tr.loss_mask) if m] == [i for s, e in spans for i in range(s, e)]
        for t in tr.turns:
            assert set(tr.turn_index[t.start : t.end]) == {t.index}
            assert all(lp <= 0 for lp in tr.logprobs[t.start : t.end])
            sampled = tr.token_ids[t.start : t.end]
            assert t.hit_token_limit == (len(sampled) == 48 and sampled[-1] != eos)
        assert all(lp == 0.0 for lp, m in zip(tr.logprobs, tr.loss_mask) if not m)
        assert tr.turn_index == sorted(tr.turn_index) and tr.turn_index[0] == -1
        assert not (tr.terminated and tr.truncated)
        if tr.stop_reason is not None:  # a rollout limit (the env may also truncate, e.g. attempts)
            assert tr.truncated and tr.stop_reason in ("max_turns", "max_context")
        # the whole episode, environment turns included, re-scored by HF: what vLLM saw is what we kept
        mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
        fresh = hf_logprobs(base_policy, [], tr.token_ids)  # [n], aligned with the tokens
        torch.testing.assert_close(fresh[mask], torch.tensor(tr.logprobs)[mask], atol=ATOL, rtol=0)
    assert any(t.hit_token_limit for tr in trajs for t in tr.turns)  # the limit was hit and recorded
    assert any(tr.num_turns == 2 for tr in trajs)


@requires_vllm
def test_lora_adapter_requests_get_new_ids_and_serve_each_update(engines):
    """The GPU route (``LoRARequest``), run on the CPU build for correctness (its speed is not the point)."""
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.loading import LoraSettings, load_policy

    policy = load_policy("default", lora=LoraSettings(r=8, alpha=16))
    backend = VLLMBackend(policy, llm=engines("adapter"), lora_sync="adapter")
    first = backend._lora_request
    context = chat_ids(policy.tokenizer, "What is 7 times 8?")
    before = sample(backend, context, seed=6)
    assert_matches_hf(policy, context, before)
    sft_step(policy, context, before, lr=2e-3)
    backend.sync()
    second = backend._lora_request
    assert second.lora_int_id == first.lora_int_id + 1 and second.lora_name != first.lora_name
    after = sample(backend, context, seed=6)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert_matches_hf(policy, context, after)


def test_merged_lora_weights_equal_peft_merge_and_leave_the_model_alone():
    """Runs without vLLM: the merged weights the CPU path pushes are peft's merge_and_unload."""
    from veriloop.agents.backends.vllm import merged_lora_weights
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    merged = dict(merged_lora_weights(policy.model))
    reference = copy.deepcopy(policy.model).merge_and_unload()
    expected = dict(reference.named_parameters())
    assert merged.keys() == expected.keys()
    for name, w in merged.items():
        torch.testing.assert_close(w, expected[name], atol=1e-6, rtol=0)
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


# ------------------------------------------------------------------------------ a stand-in for vLLM


@dataclass
class FakeCompletion:  # vllm.outputs.CompletionOutput: the fields the backend reads
    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass
class FakeLLM:
    """Records constructor kwargs, generate calls, weight loads and prefix-cache resets."""

    model: str
    kwargs: dict[str, Any]
    events: list[str] = field(default_factory=list)
    loaded: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)
    calls: list[tuple[list[Any], list[Any], Any]] = field(default_factory=list)
    script: list[FakeCompletion] = field(default_factory=list)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        model = types.SimpleNamespace(load_weights=lambda weights: self.loaded.append(list(weights)))
        worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(model=model),
            reload_weights=lambda weights_iterator: self.loaded.append(list(weights_iterator)),
        )
        self.events.append("load_weights")
        fn = getattr(worker, method) if isinstance(method, str) else partial(method, worker)
        return [fn(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        self.calls.append((prompts, sampling_params, lora_request))
        return [types.SimpleNamespace(outputs=[c]) for c in self.script[: len(prompts)]]


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the stand-in as ``vllm`` (and its submodules); yields the list of LLMs built."""
    built: list[FakeLLM] = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda model, **kw: built.append(FakeLLM(model, kw)) or built[-1]  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]  # a TypedDict in vLLM
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda name, int_id, path: types.SimpleNamespace(  # type: ignore[attr-defined]
        lora_name=name, lora_int_id=int_id, lora_path=path
    )
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)  # type: ignore[attr-defined]
    for name, module in [
        ("vllm", vllm),
        ("vllm.inputs", inputs),
        ("vllm.lora", types.ModuleType("vllm.lora")),
        ("vllm.lora.request", lora_request),
        ("vllm.platforms", platforms),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return built


def test_default_model_is_resolved_to_the_cached_checkpoint(fake_vllm, monkeypatch, tmp_path):
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.models import text as default_model
    from veriloop.agents.testing import tiny_policy

    monkeypatch.setattr(default_model, "default_model_path", lambda: tmp_path / "SmolLM2")
    policy = tiny_policy()
    policy.name, policy.meta = "default", {"base_model": "default"}  # as load_policy("default") sets them
    VLLMBackend(policy)
    assert fake_vllm[-1].model == str(tmp_path / "SmolLM2")  # not "default", which vLLM looks up on the Hub
    VLLMBackend(policy, model_path="/models/x")
    assert fake_vllm[-1].model == "/models/x"


def test_full_sync_loads_every_weight_in_place_then_drops_the_prefix_cache(fake_vllm):
    import os

    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy()
    backend = VLLMBackend(policy, model_path="/base")
    llm = fake_vllm[-1]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and not llm.kwargs["enable_lora"]
    assert llm.events == [
        "load_weights",
        "reset_prefix_cache",
    ]  # at start too: the policy may differ from disk
    with torch.no_grad():
        policy.model.model.norm.weight.add_(1.0)  # an "optimizer step"
    backend.sync()
    assert llm.events[2:] == ["load_weights", "reset_prefix_cache"]  # stale KV blocks must go after a load
    sent = dict(llm.loaded[-1])
    assert sent.keys() == dict(policy.model.named_parameters()).keys()  # tied weights once
    torch.testing.assert_close(sent["model.norm.weight"], policy.model.model.norm.weight)


def test_lora_sync_registers_a_new_adapter_each_time_and_sizes_max_rank(fake_vllm):
    from veriloop.agents.backends.vllm import VLLMBackend, lora_rank_bound
    from veriloop.agents.loading import LoraSettings, build_policy
    from veriloop.agents.testing import tiny_policy

    policy = tiny_policy(lora=True)  # r = 8
    backend = VLLMBackend(policy, model_path="/base", lora_sync="adapter")
    llm = fake_vllm[-1]
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 and not llm.loaded
    first = backend._lora_request
    backend.sync()
    second = backend._lora_request
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and first.lora_name != second.lora_name
    assert (Path(second.lora_path) / "adapter_config.json").is_file()
    assert not Path(first.lora_path).exists()  # one adapter folder on disk, not one per step
    wide = build_policy(tiny_policy().model, policy.tokenizer, lora=LoraSettings(r=20))
    assert lora_rank_bound(wide.model) == 32  # vLLM's default max_lora_rank (16) would refuse it


def test_generate_maps_sampling_params_and_results(fake_vllm):
    from veriloop.agents.backends import eos_token_ids
    from veriloop.agents.backends.vllm import VLLMBackend
    from veriloop.agents.sampling_params import SamplingParams
    from veriloop.agents.testing import tiny_policy

    backend = VLLMBackend(tiny_policy(lora=True), model_path="/base", lora_sync="adapter")
    llm = fake_vllm[-1]

    def lp(*pairs):
        return [{tok: types.SimpleNamespace(logprob=v)} for tok, v in pairs]

    llm.script = [
        FakeCompletion([5, 2], lp((5, -0.5), (2, -0.1)), "stop", None),  # end-of-turn token
        FakeCompletion([7, 8, 9], lp((7, -1.0), (8, -2.0), (9, -3.0)), "length"),
        FakeCompletion([4], lp((4, -0.2)), "stop", "###"),  # stop string
    ]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, stop=("###",), seed=3)
    reqs = [GenRequest(i, [1, 2, 3 + i], 3) for i in range(3)]
    out = backend.generate(reqs, sampling, torch.Generator().manual_seed(0))
    assert [r.finish for r in out] == ["eos", "length", "stop"]
    assert out[1].token_ids == [7, 8, 9] and out[1].logprobs == [-1.0, -2.0, -3.0]
    prompts, params, lora = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2, 3 + i]} for i in range(3)]
    assert lora is backend._lora_request
    p = params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.logprobs) == (
        0.7,
        0.9,
        -1,
        3,
        ["###"],
        0,
    )
    assert p.include_stop_str_in_output and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert p.stop_token_ids == list(eos_token_ids(backend.policy.tokenizer, backend.policy.model))
    again = backend.generate(reqs, sampling, torch.Generator().manual_seed(0))
    assert [q.seed for q in llm.calls[-1][1]] == [q.seed for q in params]  # seeds come from the generator
    assert again == out


def test_missing_vllm_names_the_extra_to_install(monkeypatch):
    from veriloop.agents.backends import make_backend

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (None makes the import fail)
    with pytest.raises(ImportError, match=r"pip install veriloop\[vllm\].*make setup-vllm"):
        make_backend("vllm", policy=None)
    with pytest.raises(ValueError, match="did you mean 'vllm'"):
        make_backend("vlm", policy=None)
