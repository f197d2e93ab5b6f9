"""Batched generation with a transformers model and its KV cache (CPU or GPU).

Each call samples one assistant turn for every request in one batched decode loop. Between turns
the backend keeps each episode's keys/values (``_Slot``), so the next turn only feeds the tokens
that are new since then (the last sampled token and the environment's delta) instead of
re-encoding the whole conversation.

Batch layout (left padding, all rows end at the same column): request ``i`` has ``T_i`` context
tokens of which ``c_i`` are cached; ``W = max_i (T_i - c_i)`` new columns are fed, and the batched
cache holds the first ``P = max_i T_i - W`` columns:

    row i:  [ pad ... | ctx[: T_i - W] (cached K/V) ][ ctx[T_i - W :] (fed now, width W) ]
             <------------- P columns -------------> <------------ W columns ------------>

Rows whose new part is shorter than ``W`` recompute a few cached tokens; that keeps one
rectangular prefill per turn. Position ids are ``column - left_pad`` so RoPE sees every episode
from position 0. Rows that finish (end-of-turn token, stop string, budget) are dropped from the
batch once ``compact_fraction`` of the rows are done, so stragglers decode in a smaller batch.

A model with recurrent layers (Qwen3.5's linear attention; :mod:`veriloop.agents.architecture`)
is served without cross-turn reuse either, and with the model's own cache, which holds their states.

Vision policies (``policy.processor`` set) are served without cross-turn reuse: each turn the
whole context, with every image so far (``GenRequest.model_inputs``), is re-encoded. A Qwen-VL
family's multimodal RoPE positions ([3, B, W], from its images' grids:
``veriloop.agents.vision.mrope_positions``) are computed for the prefill, and each decode step
goes on from the last one + 1.

Sampling always runs in eval mode (dropout off, e.g. LoRA dropout, which peft leaves in training
mode), so recorded log-probs are those of the deterministic policy that training recomputes; each
module's mode is restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from veriloop.agents.architecture import is_recurrent, say_once
from veriloop.agents.backends.base import GenRequest, GenResult, eos_token_ids, hit_stop
from veriloop.agents.forward import CACHE_ARG
from veriloop.agents.policy import Policy
from veriloop.agents.precision import base_weight, causal_lm, lora_delta, merge_delta
from veriloop.agents.sampling_params import SamplingParams, sample_next
from veriloop.agents.vision import mrope_positions

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [H, L, D]


class SpareLayer(DynamicLayer):
    """A cache layer whose keys/values [B, H, L, D] live in a buffer with spare columns, so that
    each decode step writes its column in place.

    transformers' ``DynamicLayer`` appends by concatenation: every decode step reallocates and
    copies the whole cache of every layer (16% of a batch-32 decode step on the default model).
    Here ``keys``/``values`` are views of the buffer's first ``L`` columns; running past
    ``capacity`` doubles the buffer.

    Args:
        capacity: Columns to reserve when the first keys arrive (if no buffer is given).
        buffers: Preallocated key and value buffers [B, H, C, D] whose first ``length`` columns
            are already filled.
    """

    def __init__(
        self, capacity: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None, length: int = 0
    ) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = length
        if buffers is not None:
            self.buf_k, self.buf_v = buffers
            self.keys, self.values = self.buf_k[:, :, :length], self.buf_v[:, :, :length]
            self.dtype, self.device, self.is_initialized = self.buf_k.dtype, self.buf_k.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.buf_k = key_states.new_empty(b, h, self.capacity, d)
        self.buf_v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.keys, self.values = self.buf_k[:, :, :0], self.buf_v[:, :, :0]
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.length
        m = self.length = n + key_states.shape[-2]
        if m > self.buf_k.shape[-2]:  # out of spare columns
            self.buf_k, self.buf_v = (_grown(t, max(m, 2 * t.shape[-2])) for t in (self.buf_k, self.buf_v))
        self.buf_k[:, :, n:m] = key_states
        self.buf_v[:, :, n:m] = value_states
        self.keys, self.values = self.buf_k[:, :, :m], self.buf_v[:, :, :m]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        n = self.length
        self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
        self.keys, self.values = self.buf_k[:, :, :n], self.buf_v[:, :, :n]


def _grown(buf: torch.Tensor, columns: int) -> torch.Tensor:
    out = buf.new_empty(*buf.shape[:2], columns, buf.shape[3])
    out[:, :, : buf.shape[2]] = buf
    return out


@dataclass
class _Slot:
    """One episode's cached keys/values: ``kv[l][0][:, j]`` belongs to token ``ids[j]``."""

    ids: list[int]
    kv: KV


@dataclass
class _Row:
    """Book-keeping for one request inside the decode loop."""

    index: int  # position in the request list
    pad: int  # left padding columns
    context: list[int]
    budget: int
    sampled: list[int]
    logprobs: list[float]
    finish: str | None = None


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off inside the block; every module's own training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def merged_lora(model: torch.nn.Module) -> Iterator[None]:
    """LoRA adapters folded into the base weights inside the block (peft's merge/unmerge).

    Sampling through unmerged adapters runs two extra small matmuls per adapted layer; at decode
    time (one token per row) those cost more than the layer itself: measured on the default
    model, batch 32, 2 CPU threads, 462 ms per decode step unmerged vs 192 ms merged. Unmerging
    subtracts the same delta, which gives the base weights back only up to fp32 rounding (a few
    ulps): over many steps the base drifts and a resumed run (whose checkpoint holds only the
    adapters) would diverge. So the base weights of the adapted layers are copied before the merge
    and restored exactly afterwards (memory: one copy of those layers' weights while sampling).
    Anything that is not a peft model, or is already merged, or has its adapters disabled, is left
    alone. Into bf16 base weights the adapters are folded by
    :func:`~veriloop.agents.precision.merge_delta` (dithered rounding), as for a vLLM sampler.
    """
    merge = getattr(model, "merge_adapter", None)
    named = [
        (n, m) for n, m in causal_lm(model).named_modules() if hasattr(m, "merged") and hasattr(m, "lora_A")
    ]
    layers = [m for _, m in named]
    # adapters switched off (``disable_adapter()``, e.g. sampling the reference) must stay off
    if merge is None or not layers or any(m.merged or getattr(m, "disable_adapters", False) for m in layers):
        yield
        return
    bases = [base_weight(m) for m in layers]
    with torch.no_grad():
        saved = [w.detach().clone() for w in bases]
        merge()
        for (name, layer), w, exact in zip(named, bases, saved, strict=True):
            if w.dtype == torch.bfloat16 and (delta := lora_delta(layer)) is not None:
                w.copy_(merge_delta(exact, delta, key=f"{name}.weight"))  # peft's sum rounds to nearest
    try:
        yield
    finally:
        with torch.no_grad():
            model.unmerge_adapter()  # type: ignore[operator]
            for w, exact in zip(bases, saved, strict=True):
                w.copy_(exact)  # bit-exact base weights, whatever the subtraction's rounding


class HFBackend:
    """Generation backend for a transformers causal LM (or a VLM, without KV reuse).

    Args:
        policy: The policy whose model samples.
        reuse_kv: Keep each episode's KV cache between turns (text models only).
        max_batch_size: Most requests per decode loop; requests are sorted by length and split.
        compact_fraction: Drop finished rows from the batch once this fraction has finished.
        share_prefill: Prefill identical first-turn contexts (a group's prompt) once per batch.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        reuse_kv: bool = True,
        max_batch_size: int | None = None,
        compact_fraction: float = 0.25,
        share_prefill: bool = True,
    ) -> None:
        self.policy = policy
        self.model = policy.model
        self.tokenizer = policy.tokenizer
        self.eos = set(eos_token_ids(policy.tokenizer, policy.model))
        self.pad_id = (
            policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else min(self.eos)
        )
        # a recurrent layer's state is not a slice of per-token keys/values: fresh prefill per turn
        self.recurrent = is_recurrent(policy.model)
        if self.recurrent and reuse_kv and not policy.is_vision:
            say_once(
                policy.model, "the HF engine", "prefills each turn from the whole context (no cache reuse)"
            )
        self.reuse_kv = reuse_kv and not policy.is_vision and not self.recurrent
        self.max_batch_size = max_batch_size
        self.compact_fraction = compact_fraction
        self.share_prefill = share_prefill
        self._slots: dict[Hashable, _Slot] = {}
        self.stats = {"forward_calls": 0, "fed_tokens": 0, "reused_tokens": 0, "shared_prefill_rows": 0}

    def release(self, key: Hashable) -> None:
        self._slots.pop(key, None)

    def generate(
        self, requests: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].context_ids))
        size = self.max_batch_size or max(1, len(order))
        results: list[GenResult | None] = [None] * len(requests)
        with eval_mode(self.model), merged_lora(self.model):
            for start in range(0, len(order), size):
                chunk = order[start : start + size]
                for i, res in zip(
                    chunk, self._generate_batch([requests[i] for i in chunk], sampling, generator)
                ):
                    results[i] = res
        return [r for r in results if r is not None]

    # ---- one batch -------------------------------------------------------------------------

    def _cached_length(self, req: GenRequest) -> int:
        """How many leading context tokens have usable cached K/V (at least one token stays new)."""
        slot = self._slots.get(req.key) if self.reuse_kv else None
        if slot is None:
            return 0
        n = len(slot.ids)
        ctx = req.context_ids
        if n >= len(ctx) or list(ctx[:n]) != slot.ids:
            self._slots.pop(req.key, None)  # diverged: recompute from scratch
            return 0
        return n

    @torch.inference_mode()
    def _generate_batch(
        self, reqs: Sequence[GenRequest], sampling: SamplingParams, generator: torch.Generator
    ) -> list[GenResult]:
        device = self.policy.device
        rows, logits, cache, mask, pos = self._prefill(reqs, sampling, device)
        active = list(range(len(rows)))  # batch row b -> rows[active[b]]
        done: list[int] = []
        next_pos = pos[..., -1] + 1  # [B] ([3, B] for multimodal RoPE)
        while True:
            tokens, lps = sample_next(logits, sampling, generator)  # [B], [B]
            for b, r in enumerate(active):
                row = rows[r]
                if row.finish is None:
                    self._append(row, int(tokens[b]), float(lps[b]), sampling)
            if all(rows[r].finish is not None for r in active):
                break
            finished = [b for b, r in enumerate(active) if rows[r].finish is not None]
            if finished and len(finished) >= self.compact_fraction * len(active):
                keep = [b for b in range(len(active)) if rows[active[b]].finish is None]
                self._save(
                    cache,
                    [rows[active[b]] for b in finished],
                    [reqs[active[b]].key for b in finished],
                    finished,
                )
                done += [active[b] for b in finished]
                index = torch.tensor(keep)
                self._select_rows(cache, index)
                tokens, mask, next_pos = tokens[index], mask[index], next_pos[..., index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos[..., None], cache, device)
            next_pos = next_pos + 1
        self._save(cache, [rows[r] for r in active], [reqs[r].key for r in active], list(range(len(active))))
        return [GenResult(row.sampled, row.logprobs, row.finish or "length") for row in rows]  # type: ignore[arg-type]

    def _prefill(
        self, reqs: Sequence[GenRequest], sampling: SamplingParams, device: torch.device
    ) -> tuple[list[_Row], torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """Left-padded forward of every request's uncached context (each distinct one once when
        ``share_prefill``). Returns the rows, the next-token logits [B, V], the cache, the
        attention mask [B, P + W] and the positions [B, W] of the tokens fed ([3, B, W]: multimodal RoPE)."""
        cached = [self._cached_length(r) for r in reqs]
        lengths = [len(r.context_ids) for r in reqs]
        width = max(t - c for t, c in zip(lengths, cached))  # W
        total = max(lengths)  # T_max
        past = total - width  # P
        rows = [
            _Row(i, total - t, list(r.context_ids), min(r.max_new_tokens, sampling.max_new_tokens), [], [])
            for i, (r, t) in enumerate(zip(reqs, lengths))
        ]
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)  # [B, W]
        mask = torch.zeros(len(reqs), total, dtype=torch.long)  # [B, P + W]
        for b, row in enumerate(rows):
            fed = row.context[max(0, len(row.context) - width) :]
            ids[b, width - len(fed) :] = torch.tensor(fed)
            mask[b, row.pad :] = 1
        cols = torch.arange(past, total)[None, :]  # [1, W]
        pos = (cols - torch.tensor([r.pad for r in rows])[:, None]).clamp(min=0)  # [B, W]
        extra = self._vision_inputs(reqs)
        # a Qwen-VL family's multimodal RoPE: positions [3, B, W] from the images' grids (prefill is
        # the whole context for a VLM: past is 0); each decode step goes on from the last one + 1
        rope = mrope_positions(self.model, ids, mask, extra) if extra and past == 0 else None
        # a group's samples start from the same prompt: prefill each distinct context once, then
        # copy its keys/values and logits to the rows that share it (first turn, text only)
        first: dict[tuple[int, ...], int] = {}
        inverse = [first.setdefault(tuple(r.context_ids), b) for b, r in enumerate(reqs)]
        share = self.share_prefill and past == 0 and not extra and len(first) < len(reqs)
        fed = sorted(first.values()) if share else list(range(len(reqs)))
        cache = self._batched_cache([reqs[b].key for b in fed], [rows[b] for b in fed], past, width)
        self.stats["fed_tokens"] += int(mask[fed, past:].sum())
        self.stats["reused_tokens"] += sum(max(0, t - width) for t in lengths)
        logits = self._forward(
            ids[fed], mask[fed], pos[fed] if rope is None else rope, cache, device, **extra
        )
        if share:
            slot_of = {b: j for j, b in enumerate(fed)}  # request -> its row in the prefill batch
            expand = torch.tensor([slot_of[b] for b in inverse])
            logits = logits[expand.to(logits.device)]
            self._select_rows(cache, expand.to(device))
            self.stats["shared_prefill_rows"] += len(reqs) - len(fed)
        return rows, logits, cache, mask, pos if rope is None else rope

    def _append(self, row: _Row, token: int, logprob: float, sampling: SamplingParams) -> None:
        row.sampled.append(token)
        row.logprobs.append(logprob)
        if token in self.eos:
            row.finish = "eos"
        elif hit_stop(self.tokenizer, row.sampled, sampling.stop):
            row.finish = "stop"
        elif len(row.sampled) >= row.budget:
            row.finish = "length"

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        cache: Any,
        device: torch.device,
        **extra: Any,
    ) -> torch.Tensor:
        """One forward pass; returns the last column's logits [B, V]."""
        self.stats["forward_calls"] += 1
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_ARG: cache},
            **extra,
        )
        return out.logits[:, -1]

    # ---- caches ------------------------------------------------------------------------------

    def _select_rows(self, cache: Any, index: torch.Tensor) -> None:
        """Keep (or repeat) the cache's rows ``index``; a recurrent layer's states go along (its
        ``reorder_cache``: transformers gives those layers no ``batch_select_indices``)."""
        if self.recurrent:
            cache.reorder_cache(index)
        else:
            cache.batch_select_indices(index)

    def _batched_cache(self, keys: Sequence[Hashable], rows: Sequence[_Row], past: int, width: int) -> Any:
        """The turn's cache: the first ``past`` columns of every row (zeros on left padding), in
        buffers with room for the ``width`` fed columns and every row's token budget."""
        from transformers import DynamicCache

        capacity = past + width + max(r.budget for r in rows)
        config = self.model.config.get_text_config()
        if self.recurrent:  # the model's own layers: recurrent states beside keys/values (past is 0)
            return DynamicCache(config=config)
        cache = DynamicCache()
        if past == 0:
            cache.layers = [SpareLayer(capacity) for _ in range(config.num_hidden_layers)]  # type: ignore[misc]
            return cache
        # each slot leaves the store as it is copied into the batch (and is saved again at the end
        # of the turn): holding both would keep every episode's keys/values twice during a turn
        slots = [self._slots.pop(k, None) for k in keys]
        ref = next(s for s in slots if s is not None).kv
        layers: list[Any] = []
        for layer, (k0, v0) in enumerate(ref):
            k = k0.new_empty(len(rows), k0.shape[0], capacity, k0.shape[2])  # [B, H, C, D]
            v = v0.new_empty(len(rows), v0.shape[0], capacity, v0.shape[2])
            k[:, :, :past].zero_()
            v[:, :, :past].zero_()
            for b, (row, slot) in enumerate(zip(rows, slots)):
                n = past - row.pad  # cached columns used by this row
                if n > 0 and slot is not None:
                    k[b, :, row.pad : past] = slot.kv[layer][0][:, :n]
                    v[b, :, row.pad : past] = slot.kv[layer][1][:, :n]
            layers.append(SpareLayer(capacity, (k, v), past))
        cache.layers = layers
        return cache

    def _save(
        self, cache: Any, rows: Sequence[_Row], keys: Sequence[Hashable], batch_rows: Sequence[int]
    ) -> None:
        """Store each finished row's K/V: its context plus all sampled tokens but the last (never fed)."""
        if not self.reuse_kv:
            return
        for row, key, b in zip(rows, keys, batch_rows):
            ids = row.context + row.sampled[:-1]
            start, end = row.pad, row.pad + len(ids)
            kv = [
                (layer.keys[b, :, start:end].clone(), layer.values[b, :, start:end].clone())
                for layer in cache.layers
            ]
            self._slots[key] = _Slot(ids, kv)

    def _vision_inputs(self, reqs: Sequence[GenRequest]) -> dict[str, Any]:
        """Concatenate every request's vision inputs in batch order (images of row 0 first)."""
        if not any(r.model_inputs for r in reqs):
            return {}
        names = set().union(*(r.model_inputs.keys() for r in reqs))
        device = self.policy.device
        return {
            n: torch.cat([r.model_inputs[n] for r in reqs if n in r.model_inputs]).to(device) for n in names
        }
