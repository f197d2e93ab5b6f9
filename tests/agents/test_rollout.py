"""The batched multi-turn rollout engine on a tiny random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest
import torch

import veriloop.envs  # noqa: F401  (registers veriloop/...)
from veriloop.agents.backends.hf import HFBackend
from veriloop.agents.engine import EpisodeSpec, RolloutLimits, grouped_specs, rollout
from veriloop.agents.episode_log import read_episodes, replay
from veriloop.agents.forward import token_logprobs
from veriloop.agents.sampling_params import SamplingParams, filtered_logprobs
from veriloop.agents.scripted import ScriptedPolicy
from veriloop.envs.verifiers.verdict import Verdict

P24 = "veriloop/Points24-text-v0"
COUNTDOWN = "veriloop-test/Countdown-v0"


class CountdownEnv(gym.Env):
    """Ends (terminated) after ``length`` actions; reward 1 when the action contains "ok"."""

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.observation_space = gym.spaces.Text(max_length=200)
        self.action_space = gym.spaces.Text(max_length=10_000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.n = int(self.np_random.integers(100))
        return f"Problem {self.n}: say ok.", {"task": {"n": self.n}}

    def step(self, action):
        self.t += 1
        ok = "ok" in action
        verdict = Verdict(
            correct=ok, feedback="fine" if ok else "say ok", reason="correct" if ok else "wrong"
        )
        obs = f"Step {self.t} of {self.length}: {verdict.feedback}."
        return (
            obs,
            float(ok),
            self.t >= self.length,
            False,
            {"verdict": verdict, "reward_components": {"ok": ok}},
        )


if COUNTDOWN not in gym.registry:
    gym.register(COUNTDOWN, entry_point=CountdownEnv, disable_env_checker=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def policy():
    from veriloop.agents.testing import tiny_policy

    return tiny_policy(seed=0)


def assert_recorded_logprobs_match(model, trajs):
    """Every sampled token's recorded log-prob equals a fresh full-sequence forward pass of ``model``."""
    for tr in trajs:
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            fresh, _ = token_logprobs(model, ids, torch.ones_like(ids))
        mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(fresh[0][mask], torch.tensor(tr.logprobs)[mask], atol=2e-4, rtol=1e-4)


def countdown(lengths, seed=0):
    return [EpisodeSpec(COUNTDOWN, {"length": n}, seed + i, i) for i, n in enumerate(lengths)]


def spans(mask):
    """Half-open [start, end) runs of ones."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_masks_logprobs_and_turns_line_up_over_four_turns(policy):
    trajs = rollout(policy, countdown([4, 4]), sampling=SamplingParams(max_new_tokens=12, seed=3))
    for tr in trajs:
        n = len(tr.token_ids)
        assert len(tr.loss_mask) == len(tr.logprobs) == len(tr.turn_index) == n
        assert tr.num_turns == 4 and tr.terminated and not tr.truncated and tr.stop_reason is None
        assert spans(tr.loss_mask) == [(t.start, t.end) for t in tr.turns]
        for t in tr.turns:
            assert set(tr.turn_index[t.start : t.end]) == {t.index}
            assert all(lp < 0 for lp in tr.logprobs[t.start : t.end])
        assert all(lp == 0.0 for lp, m in zip(tr.logprobs, tr.loss_mask) if m == 0)
        assert tr.turn_index[: tr.turns[0].start] == [-1] * tr.turns[0].start
        assert tr.turn_index == sorted(tr.turn_index)
        assert [t.verdict.reason for t in tr.turns] == [
            "correct" if "ok" in t.text else "wrong" for t in tr.turns
        ]


def test_environment_tokens_are_never_trainable(policy):
    tok = policy.tokenizer
    (tr,) = rollout(policy, countdown([3]), sampling=SamplingParams(max_new_tokens=10, seed=1))
    for (start, end), turn in zip(spans(tr.loss_mask), tr.turns):
        ids = tr.token_ids[start:end]
        if ids[-1] == tok.eos_token_id:
            ids = ids[:-1]
        assert tok.decode(ids, skip_special_tokens=False) == turn.text
    env_text = tok.decode(
        [i for i, m in zip(tr.token_ids, tr.loss_mask) if m == 0], skip_special_tokens=False
    )
    for k in (1, 2):  # every observation after an action sits in the untrainable part, with its header
        assert f"<|im_start|>user\nStep {k} of 3:" in env_text
    assert env_text.count("<|im_start|>assistant\n") == 3


def test_recorded_logprobs_match_a_fresh_forward_pass(policy):
    trajs = rollout(policy, countdown([3, 2, 3]), sampling=SamplingParams(max_new_tokens=16, seed=7))
    assert_recorded_logprobs_match(policy.model, trajs)


def test_tempered_truncated_logprobs_match_the_filtered_forward_pass(policy):
    sampling = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, seed=2)
    for tr in rollout(policy, countdown([3, 3]), sampling=sampling):
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0]  # [T, V]
        at = [t for t, m in enumerate(tr.loss_mask) if m]
        expected = filtered_logprobs(logits[[t - 1 for t in at]], sampling)  # [N, V]: q(. | x_<t)
        picked = expected[torch.arange(len(at)), ids[0, at]]
        assert torch.isfinite(picked).all()  # every sampled token was inside the top-k / top-p set
        torch.testing.assert_close(torch.tensor([tr.logprobs[t] for t in at]), picked, atol=2e-4, rtol=1e-4)


def test_greedy_ignores_the_seed_and_records_model_logprobs(policy):
    def run(seed):
        return rollout(policy, countdown([2, 3]), sampling=SamplingParams.greedy(8).with_seed(seed))

    a, b = run(0), run(1)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    for tr in a:
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0]
        at = [t for t, m in enumerate(tr.loss_mask) if m]
        assert ids[0, at].tolist() == logits[[t - 1 for t in at]].argmax(-1).tolist()
        fresh = torch.log_softmax(logits[[t - 1 for t in at]], -1).max(-1).values
        torch.testing.assert_close(torch.tensor([tr.logprobs[t] for t in at]), fresh, atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
def test_rollout_on_cuda_samples_what_the_cpu_samples():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from veriloop.agents.testing import tiny_policy

    cpu, gpu = tiny_policy(seed=0), tiny_policy(seed=0)
    gpu.model.to("cuda")
    sampling = SamplingParams(max_new_tokens=12, seed=9)  # the rollout's generator is a CPU one
    on_gpu = rollout(gpu, countdown([3, 2]), sampling=sampling)
    on_cpu = rollout(cpu, countdown([3, 2]), sampling=sampling)
    for g, c in zip(on_gpu, on_cpu):
        assert g.token_ids == c.token_ids  # same seed, same draws, whatever the device
        ids = torch.tensor([g.token_ids], device="cuda")
        with torch.no_grad():
            fresh, _ = token_logprobs(gpu.model, ids, torch.ones_like(ids))
        mask = torch.tensor(g.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(fresh[0].cpu()[mask], torch.tensor(g.logprobs)[mask], atol=2e-4, rtol=1e-4)


def test_sampling_runs_without_dropout_and_restores_training_mode():
    from veriloop.agents.loading import LoraSettings, build_policy
    from veriloop.agents.testing import tiny_policy

    base = tiny_policy(seed=0)
    lora = build_policy(base.model, base.tokenizer, lora=LoraSettings(r=8, alpha=16, dropout=0.5))
    with torch.no_grad():
        for name, param in lora.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))  # make the adapter matter
    lora.model.train()  # as left by an update step (and by peft right after wrapping)
    trajs = rollout(lora, countdown([2, 2]), sampling=SamplingParams(max_new_tokens=8, seed=1))
    assert lora.model.training and all(m.training for m in lora.model.modules())
    lora.model.eval()
    assert_recorded_logprobs_match(lora.model, trajs)


def test_kv_reuse_gives_the_same_tokens_as_recomputing(policy):
    sampling = SamplingParams(max_new_tokens=12, seed=5)
    a = rollout(policy, countdown([3, 1, 2]), sampling=sampling, backend=HFBackend(policy, reuse_kv=True))
    b = rollout(policy, countdown([3, 1, 2]), sampling=sampling, backend=HFBackend(policy, reuse_kv=False))
    c = rollout(
        policy, countdown([3, 1, 2]), sampling=sampling, backend=HFBackend(policy, compact_fraction=2.0)
    )
    for x, y, z in zip(a, b, c):
        assert x.token_ids == y.token_ids == z.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_kv_of_an_episode_is_held_once_while_it_decodes(policy):
    """An episode's cached keys/values move into the batch for its turn (not copied beside it)."""
    backend = HFBackend(policy)
    held: list[tuple[int, int]] = []  # (stored slots, reused tokens so far) at each forward call
    inner = backend._forward
    backend._forward = lambda *a, **k: (
        held.append((len(backend._slots), backend.stats["reused_tokens"])) or inner(*a, **k)
    )
    rollout(policy, countdown([3, 3]), sampling=SamplingParams(max_new_tokens=6), backend=backend)
    assert backend.stats["reused_tokens"] > 0  # later turns did start from the cache
    assert all(slots == 0 for slots, _ in held)  # both episodes decode together: nothing stored meanwhile


def test_finished_episodes_drop_out_of_the_batch(policy):
    backend = HFBackend(policy)
    sizes = []
    inner = backend.generate
    backend.generate = lambda reqs, *a: sizes.append(len(reqs)) or inner(reqs, *a)
    trajs = rollout(policy, countdown([1, 3, 2]), sampling=SamplingParams(max_new_tokens=6), backend=backend)
    assert sizes == [3, 2, 1]  # one generation call per turn; finished episodes leave
    assert [t.num_turns for t in trajs] == [1, 3, 2]
    assert backend._slots == {}  # caches of finished episodes are released


def test_group_episodes_share_their_start_state(policy):
    specs = grouped_specs(P24, {"max_attempts": 2}, seeds=[11, 12], group_size=3)
    assert [s.group_id for s in specs] == [0, 0, 0, 1, 1, 1]
    trajs = rollout(policy, specs, sampling=SamplingParams(max_new_tokens=8, seed=0))
    first = [tr.token_ids[: tr.turns[0].start] for tr in trajs]
    assert first[0] == first[1] == first[2] and first[3] == first[4] == first[5] and first[0] != first[3]
    assert trajs[0].task == trajs[2].task and trajs[0].task != trajs[3].task
    assert len({tuple(tr.token_ids) for tr in trajs[:3]}) == 3  # different samples from the same start


def test_same_seed_same_episodes_and_other_seed_differs(policy):
    def run(seed):
        return rollout(policy, countdown([2, 2]), sampling=SamplingParams(max_new_tokens=8, seed=seed))

    assert [t.token_ids for t in run(4)] == [t.token_ids for t in run(4)]
    assert [t.token_ids for t in run(4)] != [t.token_ids for t in run(5)]


def test_limits_are_recorded_never_silent(policy):
    sampling = SamplingParams(max_new_tokens=64, seed=0)
    tok_limit = rollout(policy, countdown([2]), sampling=sampling, limits=RolloutLimits(max_new_tokens=3))[0]
    assert all(
        t.hit_token_limit == (t.end - t.start == 3 and tok_limit.token_ids[t.end - 1] != 2)
        for t in tok_limit.turns
    )
    assert any(t.hit_token_limit for t in tok_limit.turns)

    turns = rollout(policy, countdown([5]), sampling=sampling, limits=RolloutLimits(max_turns=2))[0]
    assert (turns.num_turns, turns.truncated, turns.terminated, turns.stop_reason) == (
        2,
        True,
        False,
        "max_turns",
    )

    prompt_len = (
        len(rollout(policy, countdown([1]), sampling=sampling)[0].token_ids) - 1
    )  # a bound on the prompt
    ctx = rollout(
        policy, countdown([5]), sampling=sampling, limits=RolloutLimits(max_context=prompt_len + 20)
    )[0]
    assert ctx.truncated and ctx.stop_reason == "max_context" and not ctx.terminated
    assert len(ctx.token_ids) <= prompt_len + 20


def test_episode_log_replays_identically(policy, tmp_path):
    def answer(turn, obs, task):
        cards = ", ".join(f'"{c[:-1]}"' for c in task["cards"])
        return f'{{"cards": [{cards}], "formula": "{task["solution"]}"}}' if turn == 1 else "I am not sure."

    log = tmp_path / "episodes.jsonl"
    specs = grouped_specs(P24, {"max_attempts": 3}, seeds=[0, 1], group_size=2)
    trajs = rollout(ScriptedPolicy(answer, policy.tokenizer), specs, sampling=SamplingParams(), log_path=log)
    rollout(policy, specs[:2], sampling=SamplingParams(max_new_tokens=8), log_path=log)  # appends
    lines = log.read_text().splitlines()
    assert len(lines) == 6
    for line, record in zip(lines, read_episodes(log)):
        again = replay(line)
        assert [a["reward"] for a in again] == [t["reward"] for t in record["turns"]]
        assert [a["verdict"] for a in again] == [t["verdict"] for t in record["turns"]]
    assert (
        json.loads(lines[0])["turns"][0]["ids"]
        == trajs[0].token_ids[trajs[0].turns[0].start : trajs[0].turns[0].end]
    )
    assert trajs[0].turns[1].verdict.correct and trajs[0].terminated


def test_stop_strings_end_a_turn_and_keep_the_completing_token(policy):
    from veriloop.agents.backends import GenRequest

    backend = HFBackend(policy)
    prompt = policy.tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    greedy = SamplingParams.greedy(max_new_tokens=8)
    (free,) = backend.generate([GenRequest("a", prompt, 8)], greedy, torch.Generator())
    stop = policy.tokenizer.decode(free.token_ids[2:3])
    (cut,) = backend.generate(
        [GenRequest("b", prompt, 8)], SamplingParams.greedy(8, stop=(stop,)), torch.Generator()
    )
    assert cut.finish == "stop" and 1 <= len(cut.token_ids) <= 3
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and stop in policy.tokenizer.decode(
        cut.token_ids
    )


def test_lora_rollouts_sample_merged_and_give_the_base_weights_back():
    """Sampling folds the adapter in (fast decode); log-probs still match the unmerged model and the
    base weights come back bit-exact, even after many merge/unmerge cycles (a resumed run, whose
    checkpoint holds only the adapters, depends on it)."""
    from veriloop.agents.backends.hf import merged_lora
    from veriloop.agents.testing import tiny_policy

    p = tiny_policy(lora=True, seed=1)
    with torch.no_grad():  # peft starts lora_B at 0, which would make merging a no-op
        for name, w in p.model.named_parameters():
            if "lora_B" in name:
                w.normal_(std=0.5)
    base = {n: w.detach().clone() for n, w in p.model.named_parameters() if "lora_" not in n}
    layers = [m for m in p.model.modules() if hasattr(m, "merged") and hasattr(m, "lora_A")]
    with merged_lora(p.model):
        assert layers and all(m.merged for m in layers)
    with p.model.disable_adapter(), merged_lora(p.model):  # sampling the reference: adapters stay off
        assert not any(m.merged for m in layers)

    trajs = rollout(p, countdown([3, 2, 3]), sampling=SamplingParams(max_new_tokens=16, seed=7))
    assert not any(m.merged for m in layers)
    for tr in trajs:
        ids = torch.tensor([tr.token_ids])
        with torch.no_grad():
            fresh, _ = token_logprobs(p.model, ids, torch.ones_like(ids))  # unmerged adapters
        mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(fresh[0][mask], torch.tensor(tr.logprobs)[mask], atol=2e-4, rtol=1e-4)
    for _ in range(50):
        with merged_lora(p.model):
            pass
    for n, w in p.model.named_parameters():
        if n in base:
            assert torch.equal(w.detach(), base[n]), f"{n} drifted"


def test_a_groups_shared_prompt_is_prefilled_once(policy):
    """Episodes of one group start from the same context: one prefill row per distinct prompt, the
    keys/values copied to the others; every recorded log-prob still equals a fresh forward pass."""
    specs = grouped_specs("veriloop/Points24-text-v0", {"max_attempts": 2}, [3, 4], group_size=3)
    backend = HFBackend(policy)
    fed_rows: list[int] = []
    inner = backend._forward
    backend._forward = lambda ids, *a, **k: fed_rows.append(len(ids)) or inner(ids, *a, **k)
    trajs = rollout(policy, specs, sampling=SamplingParams(max_new_tokens=6, seed=3), backend=backend)
    assert fed_rows[0] == 2 and backend.stats["shared_prefill_rows"] == 4  # 6 episodes, 2 prompts
    assert len({tuple(t.token_ids) for t in trajs}) > 2  # the copies sampled on their own
    assert_recorded_logprobs_match(policy.model, trajs)
