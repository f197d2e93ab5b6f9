"""The one forward pass that turns token ids into per-token log-probabilities.

Rollouts use it to check recorded sampling log-probs; algorithms use it for the policy, the
reference and the old policy. Keeping one implementation means the numbers always agree.
"""

from __future__ import annotations

from typing import Any

import torch

from veriloop.agents.architecture import is_recurrent, say_once
from veriloop.agents.packed_attention import KWARG as PACKED_KWARG
from veriloop.agents.packed_attention import PackedRows, row_mask
from veriloop.agents.packed_attention import install as install_packed_attention
from veriloop.agents.vision import token_type_inputs


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    first_position: int = 1,
    shared_prefix: int = 0,
    packed_only: bool = False,
    **model_inputs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the tokens before it.

    Args:
        model: A causal LM (or VLM) returning ``.logits`` of shape [B, T, V].
        input_ids: [B, T] token ids.
        attention_mask: [B, T], 1 on real tokens.
        temperature: Logits are divided by it, matching the sampler.
        with_entropy: Also return the per-position entropy of the distribution.
        first_position: The first position whose log-prob is needed (e.g. the first sampled
            token of the batch). Logits are computed only from there on (``logits_to_keep``): the
            vocabulary projection over a long prompt is most of the cost. Earlier positions are 0.
        shared_prefix: The first ``shared_prefix`` tokens are the same real tokens in every row
            (a GRPO group's prompt; see :func:`shared_prefix_length`). They are run once for
            every row (packed into one sequence, or a long batch from their KV cache): the same
            numbers (up to float rounding) and gradients for a fraction of the compute. Used only
            for text models (no ``model_inputs``) and when ``shared_prefix <= first_position``.
        packed_only: Share the prompt only where it packs into the rows' one forward pass, never
            through the KV cache's two (a sharded model: each of its forward passes must be
            followed by its own backward, see ``veriloop.algos.run.fsdp.is_sharded``).
        **model_inputs: Extra inputs (e.g. ``pixel_values``) passed to the model.

    Returns:
        logprobs [B, T]: position t holds log p(x_t | x_<t); position 0 is 0.
        entropy [B, T] or None: entropy of p(. | x_<t) at position t; position 0 is 0.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ"
        )
    home = input_ids.device  # the results come back here (the batch's device: the CPU)
    input_ids, attention_mask, model_inputs = on_model_device(model, input_ids, attention_mask, model_inputs)
    T = input_ids.shape[1]
    first = min(max(int(first_position), 1), max(T - 1, 1))
    keep = T - first  # logits at positions first-1 .. T-2 predict tokens first .. T-1
    if T > 1 and not model_inputs:
        # the last token predicts nothing we score: leave it out, and the logits come contiguous
        ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
        prefix = shared_prefix if 1 < shared_prefix <= first and input_ids.shape[0] > 1 else 0
        logits = _text_logits(model, ids, mask, keep, prefix, packed_only)
        logits = logits[:, -keep:]  # [B, T-first, V]; a view of the whole when the model kept only these
    else:  # multimodal inputs may be laid out per token: keep every column
        logits = _logits(model, input_ids, attention_mask, keep + 1 if first > 1 else 0, model_inputs)
        logits = logits[:, -keep - 1 : -1]
    picked, ent = _picked_logprobs(logits, input_ids[:, first:], temperature, with_entropy)
    zeros = picked.new_zeros(input_ids.shape[0], first)
    logprobs = torch.cat([zeros, picked], dim=1).to(home)  # [B, T]
    entropy = torch.cat([zeros, ent], dim=1).to(home) if ent is not None else None
    return logprobs, entropy


def on_model_device(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The inputs on the model's device (a GPU policy, a CPU batch); unchanged when they already are."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    where = param.device if param is not None else input_ids.device
    if where == input_ids.device:
        return input_ids, attention_mask, model_inputs
    moved = {k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in model_inputs.items()}
    return input_ids.to(where), attention_mask.to(where), moved


#: Rows of [rows, V] logits worked on at once on an accelerator (~200 MB of fp32 for a 49k vocabulary).
CHUNK_ROWS = 1024
#: On a CPU, fp32 bytes of logits worked on at once: a chunk that stays in a core's cache through
#: the head's ~8 elementwise passes. 2 MiB (10 rows of a 49k vocabulary) made the default model's
#: head (400 rows, forward + backward, one thread) 3.3x faster than 1024-row chunks, with the
#: same bits; every row is computed alone, so the chunking never changes a number.
CPU_CHUNK_BYTES = 2 << 20


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows per chunk of ``logits`` [R, V]: cache-sized on a CPU, ``CHUNK_ROWS`` elsewhere."""
    if logits.device.type != "cpu":
        return CHUNK_ROWS
    return max(1, CPU_CHUNK_BYTES // (4 * logits.shape[-1]))


def _picked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / T)`` at ``targets`` [B, L] (and the entropy), from logits [B, L, V].

    One autograd node (:class:`_PickedLogprob`) instead of log-softmax, gather, exp and product:
    autograd would keep several [B, L, V] tensors for the backward pass (with a 49k vocabulary,
    8 rows of 600 tokens are ~1 GB each; long multi-turn batches ran out of memory) and spend
    most of the head's time writing them. The node keeps only the logits (which the model's
    output holds anyway) and one log-sum-exp per row, works a chunk of rows at a time, and in the
    backward pass computes the softmax once per chunk; the entropy's gradient only when the loss
    uses the entropy.
    """
    b, n, v = logits.shape
    picked, entropy = _PickedLogprob.apply(
        logits.reshape(b * n, v), targets.reshape(b * n), float(temperature), with_entropy
    )
    return picked.reshape(b, n), entropy.reshape(b, n) if with_entropy else None


class _PickedLogprob(torch.autograd.Function):
    """Rows [R, V] of logits -> (log p(target), entropy), p = softmax(logits / T)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        lse = logits.new_empty(rows, dtype=torch.float32)
        picked = logits.new_empty(rows, dtype=torch.float32)
        entropy = logits.new_zeros(rows if with_entropy else 0, dtype=torch.float32)
        step = chunk_rows(logits)
        for start in range(0, rows, step):
            sl = slice(start, start + step)
            z = _scaled(logits[sl], temperature)
            top = z.amax(-1, keepdim=True)
            e = torch.sub(z, top).exp_()  # softmax numerators, once for both outputs
            total = e.sum(-1)
            lse[sl] = top[:, 0] + total.log()
            picked[sl] = z.gather(-1, targets[sl, None])[:, 0] - lse[sl]
            if with_entropy:  # H = lse - sum_j p_j z_j
                entropy[sl] = lse[sl] - e.mul_(z).sum(-1) / total
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return picked, entropy

    @staticmethod
    def backward(ctx: Any, g_picked: torch.Tensor | None, g_entropy: torch.Tensor | None) -> tuple:
        logits, targets, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        if g_entropy is not None and entropy.numel() == 0:
            g_entropy = None
        grad = torch.empty_like(logits)
        step = chunk_rows(logits)
        for start in range(0, logits.shape[0], step):
            sl = slice(start, start + step)
            z = _scaled(logits[sl], t)
            g = grad[sl] if grad.dtype == torch.float32 else torch.empty_like(z)  # fp32 arithmetic
            # d log p_y / dz = onehot(y) - p;  dH / dz = -p (log p + H), with log p = z - lse
            if g_entropy is None:
                torch.sub(z, lse[sl, None], out=g).exp_()  # p
                g.mul_(-g_picked[sl, None] if g_picked is not None else 0.0)
            else:
                p = torch.sub(z, lse[sl, None]).exp_()
                torch.sub(z, (lse[sl] - entropy[sl])[:, None], out=g)  # log p + H
                g.mul_(-g_entropy[sl, None])
                if g_picked is not None:
                    g.sub_(g_picked[sl, None])
                g.mul_(p)
            if g_picked is not None:
                g.scatter_add_(-1, targets[sl, None], g_picked[sl, None].to(g.dtype))
            if t != 1.0:
                g.div_(t)
            if g.data_ptr() != grad[sl].data_ptr():
                grad[sl] = g
        return grad, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def first_loss_position(loss_mask: torch.Tensor) -> int:
    """The first column where any row of ``loss_mask`` [B, T] is set (1 if none is)."""
    cols = loss_mask.bool().any(0).nonzero()
    return int(cols[0]) if len(cols) else 1


def _text_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    prefix: int,
    packed_only: bool,
) -> torch.Tensor:
    """A text model's logits of the last ``keep`` positions, with the rows' common ``prefix`` run
    once (packed with the rows, or through the KV cache unless ``packed_only``) when it is > 0.
    A model with recurrent layers runs every row as its own sequence (its state is not per-token
    keys/values that a mask or a shared cache could split: :mod:`veriloop.agents.architecture`)."""
    if prefix > 0 and is_recurrent(model):
        say_once(model, "the trainer", "runs each row whole (no packing or sharing of the group's prompt)")
        prefix = 0
    packed = prefix > 0 and _can_pack(model, input_ids, prefix)
    if packed or (prefix > 0 and not packed_only):
        share = _packed_prefix_logits if packed else _shared_prefix_logits
        return share(model, input_ids, attention_mask, prefix, keep)
    return _logits(model, input_ids, attention_mask, keep, {})


def _logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int, model_inputs: dict[str, Any]
) -> torch.Tensor:
    """``model(...).logits``, for the last ``keep`` positions only when ``keep`` > 0 and the model
    takes ``logits_to_keep`` (transformers' causal LMs do); all positions otherwise. A Qwen-VL
    family's images get their ``mm_token_type_ids`` (its multimodal RoPE's positions need them)."""
    if model_inputs:
        model_inputs = token_type_inputs(model, input_ids, model_inputs)
    if keep > 0:
        try:
            return model(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, **model_inputs
            ).logits
        except TypeError as e:
            if "logits_to_keep" not in str(e):
                raise
    return model(input_ids=input_ids, attention_mask=attention_mask, **model_inputs).logits


#: Shortest common prompt worth running once for a whole micro-batch (see ``token_logprobs``).
MIN_SHARED_PREFIX = 8


def usable_shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, first_position: int) -> int:
    """``token_logprobs``'s ``shared_prefix`` for these rows: their common prompt (up to
    ``first_position``) when it is at least ``MIN_SHARED_PREFIX`` tokens, else 0."""
    prefix = shared_prefix_length(input_ids, attention_mask, limit=first_position)
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int) -> int:
    """How many leading columns of ``input_ids`` [B, T] hold the same real token in every row
    (at most ``limit``, e.g. the first loss position, so no sampled token is shared)."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # [T]
    return min(int(same.long().cumprod(0).sum()), limit)


def _cache_argument() -> str:
    """The name transformers' forward takes the KV cache under: ``cache`` from 5.24 on (where
    ``past_key_values`` warns that it goes away in 5.40), ``past_key_values`` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


#: ``model(..., **{CACHE_ARG: cache})`` and ``getattr(out, CACHE_ARG)`` work on every supported transformers.
CACHE_ARG = _cache_argument()


#: Most tokens a micro-batch with a shared prompt is packed into (the prompt once, then every row's
#: continuation, as one sequence with a mask that keeps the rows apart). Packed, the model runs
#: once instead of twice (the prompt, then the rows from its KV cache): on a CPU, where each
#: operator call has a fixed cost, that made the default model's bf16 micro-batch of the GRPO
#: benchmark (4 rows x 64 tokens after an 80-token prompt) ~8% faster. SDPA computes only the
#: attention blocks the rows see (:mod:`veriloop.agents.packed_attention`), but the dense [L, L]
#: mask is still built (for an attention that is not told the layout), so a longer batch takes the
#: KV-cache path.
PACKED_MAX_TOKENS = 2048


def _can_pack(model: Any, input_ids: torch.Tensor, prefix: int) -> bool:
    """Whether :func:`_packed_prefix_logits` gives ``model`` what the KV-cache path gives: short
    enough, an SDPA attention, and no sliding window that the positions could reach."""
    b, t = input_ids.shape
    if prefix - 1 + b * (t - prefix + 1) > PACKED_MAX_TOKENS:
        return False
    from veriloop.agents.precision import FP32_ATTENTION  # SDPA with q, k, v upcast: the same mask

    packable = ("sdpa", FP32_ATTENTION)  # they take a boolean [B, 1, Q, K] mask as it is
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    configs = [config, get_text() if callable(get_text) else config]  # a VLM's language model has its own
    if any(getattr(c, "_attn_implementation", None) not in packable for c in configs):
        return False
    windows = [w for c in configs if (w := getattr(c, "sliding_window", None)) is not None]
    return all(t <= w for w in windows)


def _packed_prefix_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int, keep: int
) -> torch.Tensor:
    """:func:`_shared_prefix_logits` as one forward pass: columns ``0 .. prefix-2`` once, then each
    row's columns from ``prefix - 1`` on, in one sequence [1, prefix - 1 + B n]. Each token keeps
    its row's position id and attends to the prompt and to its own row's earlier real tokens; the
    logits of each row's last ``keep`` positions come back as [B, keep, V]. The mask over the whole
    sequence is what any attention would need; SDPA is also told the layout and computes only the
    blocks it lets through (:mod:`veriloop.agents.packed_attention`)."""
    b, t = input_ids.shape
    head, n = prefix - 1, t - prefix + 1  # the prompt run once; each row's continuation
    dev = input_ids.device
    ids = torch.cat([input_ids[0, :head], input_ids[:, head:].reshape(-1)])[None]  # [1, L]
    positions = torch.cat(
        [torch.arange(head, device=dev), torch.arange(head, t, device=dev).repeat(b)]
    )  # [L]
    row = torch.cat([torch.full((head,), -1, device=dev), torch.arange(b, device=dev).repeat_interleave(n)])
    real = torch.cat(
        [torch.ones(head, dtype=torch.bool, device=dev), attention_mask[:, head:].reshape(-1).bool()]
    )
    # query i sees key j: not later, in the prompt (row -1) or in i's own row, and a real token
    sees = (positions[None, :] <= positions[:, None]) & (
        (row[None, :] == -1) | (row[None, :] == row[:, None])
    )
    sees &= real[None, :]  # [L, L]
    kept = (
        head + torch.arange(b, device=dev)[:, None] * n + torch.arange(n - keep, n, device=dev)
    )  # [B, keep]
    install_packed_attention()  # SDPA computes only the blocks the mask lets through
    rows = PackedRows(head, b, n, row_mask(attention_mask, head))
    out = model(
        input_ids=ids,
        attention_mask=sees[None, None],
        position_ids=positions[None],
        use_cache=False,
        logits_to_keep=kept.reshape(-1),
        **{PACKED_KWARG: rows},
    )
    return out.logits.view(b, keep, -1)


def _shared_prefix_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int, keep: int
) -> torch.Tensor:
    """Logits of the last ``keep`` positions, with columns ``0 .. prefix-2`` run once for all rows.

    The prefix's keys/values (one row, with their autograd graph) are expanded to B rows, so the
    backward pass sums every row's gradient into the one prefix computation. The continuation
    starts at column ``prefix - 1``, whose logits predict the first token after the prefix.
    """
    b, t = input_ids.shape
    head = model(input_ids=input_ids[:1, : prefix - 1], use_cache=True, logits_to_keep=1)
    cache = getattr(head, CACHE_ARG)
    for layer in cache.layers:  # [1, H, P-1, D] -> [B, H, P-1, D], no copy
        layer.keys = layer.keys.expand(b, -1, -1, -1)
        layer.values = layer.values.expand(b, -1, -1, -1)
    positions = torch.arange(prefix - 1, t, device=input_ids.device).expand(b, -1)  # [B, T-P+1]
    out = model(
        input_ids=input_ids[:, prefix - 1 :],
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=keep,
        **{CACHE_ARG: cache},
    )
    return out.logits
