"""Advantage estimators as pure functions over tensors.

Each function states its equation, the paper it comes from and the shapes it takes. Nothing here
reads a config: hyperparameters are arguments (``algorithm.resolve`` picks the estimator once and
``algos/learner/credit.py`` calls it on each rollout batch).

Shapes: N episodes, K turns (or actions) per episode, B x T token batches.
``valid [N]`` (bool, optional) marks episodes whose reward is known; an episode whose verifier
failed (``verdict["error"]`` set) is *not* a wrong answer, so it is left out of every baseline and
gets advantage 0 (see ``veriloop.envs.verifiers.verdict``).
"""

from __future__ import annotations

import torch

from veriloop.configs.algo import EpisodeLevel, ProcessBaseline


def _check_1d(name: str, x: torch.Tensor, n: int | None = None) -> None:
    if x.dim() != 1 or (n is not None and x.shape[0] != n):
        want = "[N]" if n is None else f"[{n}]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _check_same(names: tuple[str, ...], *xs: torch.Tensor, dims: int) -> None:
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) != 1 or xs[0].dim() != dims:
        got = ", ".join(f"{n}={tuple(x.shape)}" for n, x in zip(names, xs))
        raise ValueError(f"expected {', '.join(names)} to share one {dims}-d shape, got {got}")


def _valid(valid: torch.Tensor | None, rewards: torch.Tensor) -> torch.Tensor:
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must match rewards {tuple(rewards.shape)}")
    return valid.bool()


def _group_sums(keys: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-key count, sum and sum of squares of ``x`` weighted by ``w`` (0/1), gathered back [N]."""
    _, inv = torch.unique(keys, return_inverse=True)
    m = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(m, dtype=x.dtype).index_add_(0, inv, w)
    s1 = torch.zeros(m, dtype=x.dtype).index_add_(0, inv, x * w)
    s2 = torch.zeros(m, dtype=x.dtype).index_add_(0, inv, x * x * w)
    return count[inv], s1[inv], s2[inv]


def group_normalized(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO group-relative advantage (DeepSeekMath, Shao et al. 2024).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps) over the episodes of i's group g;
    ``std_normalize=False`` gives Dr. GRPO's A_i = R_i - mean_g(R) (Liu et al. 2025), which removes
    the difficulty bias. std is the sample (Bessel-corrected) std, as in the common GRPO code; a
    group with one valid episode gets advantage 0 (no baseline can be formed).

    Args:
        rewards: [N] episode rewards.
        group_ids: [N] integer group of each episode (same start state = same group).
        valid: [N] bool, False = verifier failed: excluded from the statistics, advantage 0.

    Returns:
        [N] advantages; every group's advantages sum to 0 (before the std division).
    """
    _check_1d("rewards", rewards)
    _check_1d("group_ids", group_ids, rewards.shape[0])
    ok = _valid(valid, rewards)
    r = rewards.double()
    n, s1, s2 = _group_sums(group_ids, r, ok.double())
    mean = s1 / n.clamp(min=1)
    adv = r - mean
    if std_normalize:
        var = (s2 - n * mean**2).clamp(min=0) / (n - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(ok & (n > 1), adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


def leave_one_out(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO advantage (Kool et al. 2019; Ahmadian et al. 2024; S2R outcome-level RL).

    A_i = R_i - 1/(G-1) * sum_{j != i, j in g} R_j, with G the number of valid episodes in group g.
    The baseline never contains R_i, so it is unbiased. A group of one valid episode has no other
    episode to compare with: its advantage is 0 (it contributes no gradient).

    Args:
        rewards: [N]; group_ids: [N]; valid: [N] bool (False = verifier failed, advantage 0).

    Returns:
        [N] advantages.
    """
    _check_1d("rewards", rewards)
    _check_1d("group_ids", group_ids, rewards.shape[0])
    ok = _valid(valid, rewards)
    r = rewards.double()
    n, s1, _ = _group_sums(group_ids, r, ok.double())
    others_mean = (s1 - r) / (n - 1).clamp(min=1)
    adv = torch.where(ok & (n > 1), r - others_mean, torch.zeros_like(r))
    return adv.to(rewards.dtype)


def batch_normalized(
    rewards: torch.Tensor, *, eps: float = 1e-6, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++ advantage (Hu 2025): A_i = (R_i - mean(R)) / (std(R) + eps) over the whole batch.

    No groups: the baseline is the batch mean, the scale the batch std (population std).

    Args:
        rewards: [N]; valid: [N] bool (False = verifier failed: left out, advantage 0).
    """
    _check_1d("rewards", rewards)
    ok = _valid(valid, rewards)
    return whiten(rewards, ok.to(rewards.dtype), eps=eps)


def whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and (population) std taken over entries where mask == 1.

    Any shape; ``mask`` has x's shape. Entries outside the mask are returned as 0.
    ``shift_mean=False`` only rescales (keeps the sign of every entry).
    """
    if x.shape != mask.shape:
        raise ValueError(f"whiten: x {tuple(x.shape)} and mask {tuple(mask.shape)} must match")
    m = mask.to(torch.float64)
    xd = x.double()
    count = m.sum().clamp(min=1)
    mean = (xd * m).sum() / count
    var = (((xd - mean) * m) ** 2).sum() / count
    out = (xd - mean) if shift_mean else xd
    out = out / (var.sqrt() + eps) * m
    return out.to(x.dtype)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over sampled tokens only (Schulman et al. 2016; PPO).

    delta_t = r_t + gamma * V(next(t)) - V(t),  A_t = delta_t + gamma * lam * A_next(t),
    where next(t) is the next position with mask == 1 (environment and template tokens are not
    steps: after the last sampled token of turn k comes the first sampled token of turn k+1).
    After the last sampled token V = 0 (the episode ended; no bootstrap). Returns_t = A_t + V(t).
    With gamma = lam = 1, A_t = sum_{s >= t, masked} r_s - V(t).

    Args:
        token_rewards: [B, T] reward on sampled tokens (usually on each turn's last token); must be
            0 where mask == 0.
        values: [B, T] critic values V(t) of the state before token t.
        mask: [B, T] 1 on sampled tokens.

    Returns:
        advantages [B, T], returns [B, T]; both 0 where mask == 0. No whitening (see ``whiten``).
    """
    _check_same(("token_rewards", "values", "mask"), token_rewards, values, mask, dims=2)
    m = mask.bool()
    if (token_rewards.masked_select(~m) != 0).any():
        raise ValueError("gae: token_rewards must be 0 outside mask (rewards belong on sampled tokens)")
    r, v = token_rewards.double(), values.detach().double()
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m[:, t], a_t, torch.zeros_like(a_t))
        next_v = torch.where(m[:, t], v[:, t], next_v)  # skip env tokens: carry the chain over them
        next_adv = torch.where(m[:, t], a_t, next_adv)
    returns = (adv + v) * m
    return adv.to(values.dtype), returns.to(values.dtype)


def turn_returns(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """Discounted return-to-go per turn: G_k = r_k + gamma * G_{k+1}, G = 0 past the last turn.

    Args:
        turn_rewards: [N, K] reward of each turn (padding turns: any value, ignored).
        turn_mask: [N, K] 1 on real turns (a prefix of each row).

    Returns:
        [N, K] returns, 0 on padding turns.
    """
    _check_same(("turn_rewards", "turn_mask"), turn_rewards, turn_mask, dims=2)
    m = turn_mask.to(turn_rewards.dtype)
    r = turn_rewards * m
    out = torch.zeros_like(r)
    g = torch.zeros_like(r[:, 0])
    for k in range(r.shape[1] - 1, -1, -1):
        g = r[:, k] + gamma * g
        out[:, k] = g * m[:, k]
    return out


def episode_rewards(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, level: EpisodeLevel) -> torch.Tensor:
    """One reward per episode from per-turn rewards.

    ``outcome``: the reward of the last real turn (S2R outcome-level); ``sum``: sum of the turn
    rewards. For per-turn credit use ``turn_level`` instead.

    Args:
        turn_rewards, turn_mask: [N, K]. Returns: [N].
    """
    _check_same(("turn_rewards", "turn_mask"), turn_rewards, turn_mask, dims=2)
    m = turn_mask.to(turn_rewards.dtype)
    if level == "sum":
        return (turn_rewards * m).sum(1)
    if level == "outcome":
        n_turns = turn_mask.long().sum(1)
        last = (n_turns - 1).clamp(min=0)
        picked = turn_rewards.gather(1, last.unsqueeze(1)).squeeze(1)
        return torch.where(n_turns > 0, picked, torch.zeros_like(picked))
    raise ValueError(
        f"episode_rewards: level must be 'outcome' or 'sum', got {level!r} (use turn_level for 'turn')"
    )


def turn_level(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    gamma: float,
    std_normalize: bool = False,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-turn advantage: return-to-go minus a leave-one-out baseline by turn index.

    A_{i,k} = G_{i,k} - b_{i,k},  b_{i,k} = mean{ G_{j,k} : j != i, j in group(i), j reached turn k }
    (optionally divided by the std of that same set when it has >= 2 members).

    Why it is unbiased: b_{i,k} is built only from *other* episodes, which are sampled independently
    of episode i, so it cannot depend on the action taken at turn k of episode i (nor on anything
    after it); hence E[grad log pi(a_{i,k}) * b_{i,k}] = 0. Only episodes that reached turn k enter,
    so an episode with fewer turns never contributes zeros to a later turn's baseline (the bias of
    naive per-turn normalisation over padded turns). The std divisor also comes from other episodes
    only, so it rescales the gradient term without biasing its direction. If no other episode of the
    group reached turn k, b = 0 (plain REINFORCE for that turn; still unbiased).

    Args:
        turn_rewards, turn_mask: [N, K]; group_ids: [N]; valid: [N] bool (False = verifier failed).

    Returns:
        [N, K] advantages, 0 on padding turns and on invalid episodes.
    """
    _check_same(("turn_rewards", "turn_mask"), turn_rewards, turn_mask, dims=2)
    _check_1d("group_ids", group_ids, turn_rewards.shape[0])
    ok = _valid(valid, group_ids)
    g = turn_returns(turn_rewards.double(), turn_mask, gamma=gamma)  # [N, K]
    w = turn_mask.double() * ok.double().unsqueeze(1)  # [N, K]
    n_k, k = g.shape
    keys = group_ids.long().unsqueeze(1) * k + torch.arange(k).unsqueeze(0)  # (group, turn) key
    cnt, s1, s2 = (t.view(n_k, k) for t in _group_sums(keys.flatten(), g.flatten(), w.flatten()))
    n_o = cnt - w  # others that reached turn k
    mean_o = (s1 - g * w) / n_o.clamp(min=1)
    adv = g - mean_o
    if std_normalize:
        var_o = ((s2 - g * g * w) / n_o.clamp(min=1) - mean_o**2).clamp(min=0) * n_o / (n_o - 1).clamp(min=1)
        adv = torch.where(n_o >= 2, adv / (var_o.sqrt() + eps), adv)
    return (adv * w).to(turn_rewards.dtype)


def process_advantages(
    action_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    action_kind: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    baseline: ProcessBaseline = "position_kind",
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """S2R process-level GRPO advantage (Ma et al. 2025): each action vs. comparable actions.

    A_{i,k} = (r_{i,k} - mean(C)) / (std(C) + eps), C = the valid actions "comparable" to (i, k):
      * ``position_kind`` (default): same group (problem), same action index k, same kind. Actions
        at the same position of the same problem face the most similar situations;
      * ``kind``: same group and kind (solve vs verify), any position;
      * ``group``: every action of the group.
    As in GRPO, C includes the action itself and std is Bessel-corrected; a set C of one action
    gets advantage 0. ``std_normalize=False`` keeps only the mean baseline.

    Args:
        action_rewards: [N, K] reward of each action (solve: +1 right / -1 wrong; verify: +1 if its
            verdict matches the truth, else -1).
        action_mask: [N, K] 1 on real actions.
        action_kind: [N, K] 0 = solve, 1 = verify.
        group_ids: [N]; valid: [N] bool (False = verifier failed, excluded, advantage 0).

    Returns:
        [N, K] advantages, 0 on padding actions.
    """
    _check_same(
        ("action_rewards", "action_mask", "action_kind"), action_rewards, action_mask, action_kind, dims=2
    )
    _check_1d("group_ids", group_ids, action_rewards.shape[0])
    n, k = action_rewards.shape
    ok = _valid(valid, group_ids)
    kind = action_kind.long()
    grp = group_ids.long().unsqueeze(1).expand(n, k)
    if baseline == "position_kind":
        keys = (grp * k + torch.arange(k).unsqueeze(0)) * 2 + kind
    elif baseline == "kind":
        keys = grp * 2 + kind
    elif baseline == "group":
        keys = grp
    else:
        raise ValueError(f"process baseline must be 'position_kind', 'kind' or 'group', got {baseline!r}")
    w = action_mask.double() * ok.double().unsqueeze(1)
    r = action_rewards.double()
    cnt, s1, s2 = (t.view(n, k) for t in _group_sums(keys.flatten(), r.flatten(), w.flatten()))
    mean = s1 / cnt.clamp(min=1)
    adv = r - mean
    if std_normalize:
        var = (s2 - cnt * mean**2).clamp(min=0) / (cnt - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(cnt > 1, adv, torch.zeros_like(adv))
    return (adv * w).to(action_rewards.dtype)


def broadcast_to_tokens(
    values: torch.Tensor, turn_index: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Spread per-episode [N] or per-turn [N, K] values onto tokens [N, T].

    Token t of episode i gets values[i] (episode level) or values[i, turn_index[i, t]] (turn level);
    0 wherever loss_mask == 0 (prompt, environment and padding tokens).
    """
    _check_same(("turn_index", "loss_mask"), turn_index, loss_mask, dims=2)
    n = turn_index.shape[0]
    if values.shape[:1] != (n,) or values.dim() not in (1, 2):
        raise ValueError(f"values must be [N] or [N, K] with N={n}, got {tuple(values.shape)}")
    m = loss_mask.bool()
    if values.dim() == 1:
        out = values.unsqueeze(1).expand_as(turn_index).to(torch.float32)
    else:
        idx = turn_index.long().clamp(min=0)
        if bool((m & (turn_index.long() >= values.shape[1])).any()) or bool((m & (turn_index < 0)).any()):
            raise ValueError(f"a sampled token has a turn index outside [0, {values.shape[1]})")
        out = values.gather(1, idx.clamp(max=max(values.shape[1] - 1, 0))).to(torch.float32)
    return torch.where(m, out, torch.zeros_like(out))
