"""token_logprobs with first_position computes only the needed logits, and agrees with the full pass."""

from __future__ import annotations

import pytest
import torch

from veriloop.agents.forward import first_loss_position, token_logprobs
from veriloop.agents.testing import tiny_policy


@pytest.fixture(scope="module")
def model():
    return tiny_policy().model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("first", [1, 2, 5, 11])
def test_first_position_matches_full_pass(first, lora):
    model = tiny_policy(lora=lora).model
    ids = torch.randint(0, model.config.vocab_size, (3, 12))
    attn = torch.ones_like(ids)
    full, full_ent = token_logprobs(model, ids, attn, with_entropy=True)
    part, part_ent = token_logprobs(model, ids, attn, with_entropy=True, first_position=first)
    assert part.shape == full.shape == (3, 12)
    torch.testing.assert_close(part[:, first:], full[:, first:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part_ent[:, first:], full_ent[:, first:], rtol=1e-5, atol=1e-5)
    assert (part[:, :first] == 0).all()


def test_first_position_asks_model_for_fewer_logits(model):
    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], kwargs.get("logits_to_keep")))
        return model(*args, **kwargs)

    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    token_logprobs(spy, ids, torch.ones_like(ids), first_position=6)
    # positions 5..8 predict tokens 6..9; the last token predicts nothing scored and is not fed
    assert seen == [(9, 4)]


def test_first_loss_position():
    m = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 0]])
    assert first_loss_position(m) == 2
    assert first_loss_position(torch.zeros(2, 4)) == 1


def _count_block_attention(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """A list that gets one entry per call of the packed sequence's block attention."""
    from veriloop.agents import packed_attention

    calls: list[int] = []
    real = packed_attention.block_attention
    monkeypatch.setattr(packed_attention, "block_attention", lambda *a: calls.append(1) or real(*a))
    return calls


def _record_prefix_paths(forward, monkeypatch) -> list[str]:
    """The names of the shared-prefix paths ``token_logprobs`` takes, in call order."""
    taken: list[str] = []
    for name in ("_packed_prefix_logits", "_shared_prefix_logits"):
        real = getattr(forward, name)
        monkeypatch.setattr(
            forward, name, lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k)
        )
    return taken


def _tiny_model_with_active_lora(lora: bool):
    from veriloop.agents.testing import tiny_policy

    model = tiny_policy(seed=3, lora=lora).model
    if lora:
        with torch.no_grad():  # peft starts lora_B at 0: make the adapter matter
            for name, w in model.named_parameters():
                if "lora_B" in name:
                    w.normal_(std=0.3)
    return model


def _group_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows sharing a 9-token prompt, with right padding on two and a hole in one."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (1, 9), generator=g)
    tails = torch.randint(3, 60, (4, 6), generator=g)
    ids = torch.cat([prompt.expand(4, -1), tails], dim=1)  # [4, 15]
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding on two rows
    mask[3, -4:] = 0
    mask[2, 12] = 0  # and a hole in one row's continuation
    return ids, mask


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("path", ["packed", "kv_cache", "packed_only"])
def test_shared_prefix_gives_the_same_logprobs_and_gradients(lora, path, monkeypatch):
    """A group's prompt run once = every row run in full, both ways of sharing it: one packed
    sequence (the prompt, then each row's continuation behind a mask) and the prompt's K/V
    expanded to every row (what a batch longer than ``PACKED_MAX_TOKENS`` takes). With
    ``packed_only`` (a sharded model) such a batch runs every row in full instead."""
    from veriloop.agents import forward
    from veriloop.agents.forward import shared_prefix_length

    if path in ("kv_cache", "packed_only"):
        monkeypatch.setattr(forward, "PACKED_MAX_TOKENS", 0)
    taken = _record_prefix_paths(forward, monkeypatch)
    blocks = _count_block_attention(monkeypatch)  # SDPA over the seen blocks only, not the dense mask
    model = _tiny_model_with_active_lora(lora)
    ids, mask = _group_rows()
    prefix = shared_prefix_length(ids, mask, limit=10)
    assert prefix == 9
    params = [p for p in model.parameters() if p.requires_grad]

    def run(shared):
        lp, ent = token_logprobs(
            model,
            ids,
            mask,
            with_entropy=True,
            first_position=10,
            shared_prefix=shared,
            packed_only=path == "packed_only",
        )
        loss = (lp * mask).sum() + 0.1 * (ent * mask).sum()
        grads = torch.autograd.grad(loss, params)
        return lp.detach(), ent.detach(), grads

    lp0, ent0, g0 = run(0)
    lp1, ent1, g1 = run(prefix)
    assert (
        taken
        == {"packed": ["_packed_prefix_logits"], "kv_cache": ["_shared_prefix_logits"], "packed_only": []}[
            path
        ]
    )
    assert len(blocks) == (model.config.num_hidden_layers if path == "packed" else 0)
    m = mask.bool()
    torch.testing.assert_close(lp1[m], lp0[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1[m], ent0[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_shared_prefix_stops_at_the_limit_and_at_the_first_difference():
    from veriloop.agents.forward import shared_prefix_length

    ids, mask = _group_rows()
    assert shared_prefix_length(ids, mask, limit=10) == 9
    assert shared_prefix_length(ids, mask, limit=4) == 4
    different = ids.clone()
    different[2, 0] = 1
    assert shared_prefix_length(different, mask, limit=10) == 0


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(("w_logp", "w_ent"), [(1.0, 0.3), (1.0, None), (None, 1.0)])
def test_log_probs_in_chunks_equal_the_whole_and_so_do_gradients(monkeypatch, temperature, w_logp, w_ent):
    """The vocabulary head's fused log-prob/entropy node, a chunk of rows at a time: the same values
    and gradients as log-softmax, gather and -sum(p log p) over everything -- also when the loss
    uses only one of the two outputs (None: left out of the loss, so autograd passes no gradient)."""
    import veriloop.agents.forward as F

    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5))

    def loss(p, e):
        return sum(w * t.sum() for w, t in ((w_logp, p), (w_ent, e)) if w is not None)

    lp = torch.log_softmax(logits / temperature, -1)
    want_p, want_e = lp.gather(-1, targets[..., None])[..., 0], -(lp.exp() * lp).sum(-1)
    (g_want,) = torch.autograd.grad(loss(want_p, want_e), logits)
    # 15 rows of 11 fp32 -> 4 chunks, the last one short
    monkeypatch.setattr(F, "CPU_CHUNK_BYTES", 4 * 11 * 4)
    assert F.chunk_rows(logits.reshape(15, 11)) == 4
    got_p, got_e = F._picked_logprobs(logits, targets, temperature, True)
    (g_got,) = torch.autograd.grad(loss(got_p, got_e), logits)
    torch.testing.assert_close(got_p, want_p)
    torch.testing.assert_close(got_e, want_e)
    torch.testing.assert_close(g_got, g_want)
    no_ent_p, no_ent = F._picked_logprobs(logits, targets, temperature, False)
    assert no_ent is None
    torch.testing.assert_close(no_ent_p, want_p)


@pytest.mark.parametrize("threads", [1, 2])
def test_chunk_size_changes_no_bit_of_the_head(monkeypatch, threads):
    """Cache-sized chunks on a CPU (a few rows of a 49k vocabulary) against one chunk of all rows:
    bit-equal log-probs, entropies and gradients, bf16 logits as in mixed precision."""
    import veriloop.agents.forward as F

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 20, 49152, generator=gen)).bfloat16()
    targets = torch.randint(0, 49152, (2, 20), generator=gen)
    weights = torch.randn(2, 20, generator=gen), torch.randn(2, 20, generator=gen)

    def head() -> list[torch.Tensor]:
        x = logits.clone().requires_grad_()
        p, e = F._picked_logprobs(x, targets, 0.7, True)
        ((weights[0] * p).sum() + (weights[1] * e).sum()).backward()
        return [p, e, x.grad]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert F.chunk_rows(logits[0]) == 10  # 2 MiB of fp32 rows
        small = head()
        monkeypatch.setattr(F, "CPU_CHUNK_BYTES", 1 << 40)  # one chunk
        whole = head()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(small, whole))


def test_half_precision_logits_get_a_half_precision_gradient_computed_in_fp32():
    import veriloop.agents.forward as F

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    half = logits.half().requires_grad_()
    full = logits.half().float().requires_grad_()
    F._picked_logprobs(half, targets, 1.0, True)[0].sum().backward()
    F._picked_logprobs(full, targets, 1.0, True)[0].sum().backward()
    assert half.grad.dtype == torch.float16
    torch.testing.assert_close(half.grad.float(), full.grad, atol=1e-3, rtol=1e-3)


def test_a_shared_prompt_is_packed_only_where_the_packed_mask_is_exact(monkeypatch):
    """Packing needs SDPA (a boolean mask taken as is), no sliding window the positions reach, and
    a short batch; anything else takes the KV-cache path."""
    from types import SimpleNamespace

    from veriloop.agents import forward

    ids = torch.zeros(4, 40, dtype=torch.long)  # packed: 9 + 4 x 31 = 133 tokens
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    assert forward._can_pack(model, ids, prefix=10)
    model.config._attn_implementation = "eager"  # adds a float mask: a boolean one would be wrong
    assert not forward._can_pack(model, ids, prefix=10)
    model.config._attn_implementation = "veriloop_sdpa_fp32"
    model.config.sliding_window = 32  # positions up to 39 would leave the window
    assert not forward._can_pack(model, ids, prefix=10)
    model.config.sliding_window = 64
    assert forward._can_pack(model, ids, prefix=10)
    text = SimpleNamespace(_attn_implementation="sdpa", sliding_window=16)  # a VLM's language model
    model.config.get_text_config = lambda: text
    assert not forward._can_pack(model, ids, prefix=10)
    text.sliding_window = None
    assert forward._can_pack(model, ids, prefix=10)
    monkeypatch.setattr(forward, "PACKED_MAX_TOKENS", 132)
    assert not forward._can_pack(model, ids, prefix=10)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_packed_block_attention_matches_full_passes_on_other_architectures(arch, monkeypatch):
    """The packed prompt's block attention on Gemma 3 (its own attention scale, sliding-window
    layers) and Qwen2 (q/k/v biases), grouped-query heads: every row's log-probs as a full pass gives."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if arch == "gemma3":
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(**shape, head_dim=8, sliding_window=64, query_pre_attn_scalar=16)
        )
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    blocks = _count_block_attention(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [torch.randint(3, 60, (1, 9), generator=g).expand(4, -1), torch.randint(3, 60, (4, 6), generator=g)],
        1,
    )
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    mask[2, 12] = 0
    with torch.no_grad():
        packed, _ = token_logprobs(model, ids, mask, first_position=10, shared_prefix=9)
        full, _ = token_logprobs(model, ids, mask, first_position=10)
    assert len(blocks) == 2  # one per layer
    torch.testing.assert_close(packed[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)
