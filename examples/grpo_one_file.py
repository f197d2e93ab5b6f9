"""GRPO in one file: the whole algorithm on one screen, over veriloop's public API only.

    python examples/grpo_one_file.py                    # SmolLM2-135M-Instruct + LoRA, 4 steps of 8 x 8 episodes
    python examples/grpo_one_file.py --tiny --steps 2   # a tiny random model: seconds (the test suite runs this)

One step: roll out G answers to each of B math problems (the verifier pays +1 for a correct answer, -1 otherwise),
turn the rewards into group-normalised advantages, recompute the sampled tokens' log-probs under the
policy being trained, take PPO's clipped surrogate, aggregate it per sequence, backward, step.
``veriloop train`` runs this same step with everything around it (checkpoints, logging, held-out
evaluation, vLLM, async, multi-turn samples, KL, other losses); this file shows only the core.
"""

from __future__ import annotations

import argparse

import torch

import veriloop.envs  # noqa: F401  (registers the veriloop/... environments)
from veriloop.agents import (
    EpisodeSpec,
    LoraSettings,
    Policy,
    RolloutLimits,
    SamplingParams,
    Trajectory,
    load_policy,
    rollout,
    token_logprobs,
)
from veriloop.algos.maths.advantages import group_normalized
from veriloop.algos.maths.losses import aggregate, clipped_pg_loss

ENV = "veriloop/MathVerify-v0"  # one answer per episode: reward +1 if math-verify accepts it, else -1


def make_policy(tiny: bool) -> Policy:
    """The default model with a fresh LoRA adapter, or a tiny random Llama (same tokenizer) for tests."""
    if tiny:
        from veriloop.agents.testing import tiny_policy

        return tiny_policy(lora=True)
    return load_policy("default", lora=LoraSettings(r=16, alpha=32))


def play(policy: Policy, step: int, problems: int, group: int, max_new_tokens: int) -> list[Trajectory]:
    """``group`` episodes for each of ``problems`` training problems; a group shares its problem (seed)."""
    seeds = range(step * problems, (step + 1) * problems)  # new problems every step
    specs = [EpisodeSpec(ENV, {}, seed=s, group_id=g) for g, s in enumerate(seeds) for _ in range(group)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=step)
    return rollout(policy, specs, sampling=sampling, limits=RolloutLimits(max_turns=1, max_context=1024))


def collate(trajectories: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the episodes' token records into tensors. Token in, token out: the ids are exactly
    what the sampler saw and drew; ``loss_mask`` is 1 on drawn tokens, ``logprobs`` is the sampler's
    log mu of each drawn token (0 elsewhere)."""
    width = max(len(t.token_ids) for t in trajectories)

    def pad(rows: list[list], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

    return {
        "input_ids": pad([t.token_ids for t in trajectories], pad_id, torch.long),  # [N, T]
        "attention_mask": pad([[1] * len(t.token_ids) for t in trajectories], 0, torch.long),  # [N, T]
        "loss_mask": pad([t.loss_mask for t in trajectories], 0, torch.float32),  # [N, T]
        "old_logprobs": pad([t.logprobs for t in trajectories], 0.0, torch.float32),  # [N, T]
    }


def grpo_step(
    policy: Policy, optimizer: torch.optim.Optimizer, batch: dict, advantages: torch.Tensor
) -> dict:
    """One gradient step of the clipped surrogate, aggregated GRPO's way (mean over each sequence's
    tokens, then over sequences). Returns the loss and a few diagnostics."""
    logprobs, _ = token_logprobs(policy.model, batch["input_ids"], batch["attention_mask"])  # [N, T]
    mask = batch["loss_mask"]
    adv = advantages[:, None].expand_as(logprobs)  # [N, T]: each token carries its episode's advantage
    per_token, stats = clipped_pg_loss(
        logprobs, batch["old_logprobs"], adv, mask, clip_low=0.2, clip_high=0.28
    )
    loss = aggregate(per_token, mask, "seq_mean_token_mean")
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), max_norm=1.0)
    optimizer.step()
    # on-policy check: before this step's update, the trainer's log-probs equal the sampler's
    drift = ((logprobs.detach() - batch["old_logprobs"]).abs() * mask).max()
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "logprob_drift": float(drift),
        **stats,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the default one")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--problems", type=int, default=8, help="B: problems per step")
    parser.add_argument("--group", type=int, default=8, help="G: answers per problem")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--lr", type=float, default=2e-4)  # the quickstart's RL step for LoRA
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    policy = make_policy(args.tiny)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=args.lr)
    pad_id = policy.tokenizer.pad_token_id or 0
    history = []
    for step in range(args.steps):
        trajectories = play(policy, step, args.problems, args.group, args.max_new_tokens)
        rewards = torch.tensor([t.total_reward for t in trajectories])  # [N]
        groups = torch.tensor([t.group_id for t in trajectories])  # [N]
        # A_i = (R_i - mean of its group) / (std of its group + eps); a group whose answers all
        # scored the same gets A = 0 everywhere: it carries no learning signal
        advantages = group_normalized(rewards, groups)
        stats = grpo_step(policy, optimizer, collate(trajectories, pad_id), advantages)
        stats["reward"] = float(rewards.mean())
        history.append(stats)
        print(
            f"step {step}: reward {stats['reward']:.3f}  loss {stats['loss']:+.4f}  "
            f"grad norm {stats['grad_norm']:.3f}  |log pi - log mu| max {stats['logprob_drift']:.1e}"
        )
    return history


if __name__ == "__main__":
    main()
