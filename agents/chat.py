"""Chat-template bookkeeping for token-in, token-out rollouts.

The conversation is never re-tokenized. The first prompt is rendered once; after that only the
environment's new message is tokenized, as a chat-template *delta*:

    delta_text = render(conv + [user], add_generation_prompt=True) - render(conv)

where ``render(conv)`` closes the last assistant turn the way the template does (for ChatML:
``content + "<|im_end|>\\n"``). The sampled tokens already contain part of that closing text when
the model emitted its end-of-turn token (``<|im_end|>``); the rest (``"\\n"``), or all of it when the
sample hit the token limit, is put in front of the delta. Those closing tokens are template
tokens, not model samples, so they are never trainable (``loss_mask == 0``).

Text from the model or the environment is never read as template markup: a message content that
spells a special token (``<|im_end|>\n<|im_start|>system\n...`` written by the model, or echoed by
an environment's feedback) is tokenized with special-token parsing off, as the ordinary text tokens
it is, and only the template's own special tokens become special ids (:meth:`ChatFormat.prompt_ids`,
:meth:`ChatFormat.delta_ids_or_none`). The template is rendered once with a placeholder per content
to find where each content lies; a template that rewrites content so that it cannot be found
(and every vision format, whose processor tokenizes) gets the content's special-token strings
broken up with a WORD JOINER (U+2060) instead, which also leaves them ordinary text.

Observations: a ``str`` becomes a user message; a vision observation ``{"text": str, "image":
uint8 [H, W, 3]}`` becomes a user message whose content is ``[{"type": "image"}, {"type": "text",
"text": ...}]`` (the image itself travels separately, see the HF backend's vision path).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_SENTINEL = "\u2063VERILOOP_SENTINEL\u2063"
_MARK = "\u2063VERILOOP_CONTENT_{}\u2063"
_MARK_RE = re.compile("\u2063VERILOOP_CONTENT_(\\d+)\u2063")
_JOINER = "\u2060"

#: A rendered text and the character spans ``[start, end)`` in it that are message contents.
Guarded = tuple[str, list[tuple[int, int]]]


def observation_message(obs: Any) -> tuple[dict[str, Any], Any]:
    """Turn an environment observation into a user message (and its image, if any).

    Returns:
        (message, image): ``image`` is the observation's array, or ``None`` for text observations.
    """
    if isinstance(obs, str):
        return {"role": "user", "content": obs}, None
    if isinstance(obs, dict) and "text" in obs:
        image = obs.get("image")
        if image is None:
            return {"role": "user", "content": str(obs["text"])}, None
        content = [{"type": "image"}, {"type": "text", "text": str(obs["text"])}]
        return {"role": "user", "content": content}, image
    raise TypeError(
        f"expected an observation that is a str or a dict with 'text' (and optionally 'image'), "
        f"got {type(obs).__name__}; veriloop environments return one of these"
    )


def text_only(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list contents flattened to their text (for logs and text templates)."""
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        out.append({"role": m["role"], "content": content})
    return out


class ChatFormat:
    """Renders prompts and deltas with a tokenizer's chat template.

    Args:
        tokenizer: A tokenizer with a ``chat_template``.
        system_prompt: Optional system message put before the first observation.
        processor: A vision policy's processor (it renders and tokenizes images).
        assistant_prefix: Text every model turn starts with (``env.assistant_prefix``): its ids,
            :attr:`prefix_ids`, follow each generation prompt (the rollout engine appends them), and
            a turn's response is the prefix and its sampled text. Special-token strings in it are read as special tokens (a
            Qwen3 ``<think>`` is one id), since it is the user's configuration, not model output.
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        processor: Any = None,
        assistant_prefix: str | None = None,
    ) -> None:
        owner = processor if processor is not None else tokenizer
        if getattr(owner, "chat_template", None) is None:
            raise ValueError(
                f"{type(owner).__name__} has no chat_template; load an instruct model's "
                "tokenizer (e.g. SmolLM2-135M-Instruct) or set its chat_template"
            )
        self.tokenizer = tokenizer
        self.processor = processor
        self.system_prompt = system_prompt
        self.eos_text = tokenizer.eos_token or ""
        added = {str(t): int(i) for t, i in tokenizer.get_added_vocab().items() if str(t)}
        self.special_ids = added  # every string the tokenizer would read as one added token
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._special_re = re.compile(pattern) if pattern else None
        self.assistant_close = self._assistant_close()
        self._check_prompt_rendered()
        self.assistant_prefix = assistant_prefix or ""
        self.prefix_ids = self._prefix_ids()

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        """Template text of ``messages``; vision formats keep image parts as placeholders."""
        if self.processor is None:
            return self.tokenizer.apply_chat_template(
                text_only(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        parts = [
            {
                **m,
                "content": [{"type": "text", "text": self.defuse(m["content"])}]
                if isinstance(m["content"], str)
                else [{**c, "text": self.defuse(c["text"])} if "text" in c else c for c in m["content"]],
            }
            for m in messages
        ]
        return self.processor.apply_chat_template(
            parts, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens are already written out in it)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def defuse(self, text: str) -> str:
        """``text`` with every special-token string broken by a WORD JOINER after its first
        character: ordinary text to any tokenizer (the fallback where content cannot be located)."""
        if self._special_re is None:
            return text
        return self._special_re.sub(lambda m: m.group()[0] + _JOINER + m.group()[1:], text)

    def _spells_special(self, messages: Sequence[dict[str, Any]]) -> bool:
        return self._special_re is not None and any(
            self._special_re.search(m["content"]) for m in text_only(messages)
        )

    def render_guarded(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> Guarded:
        """:meth:`render`'s text and where the message contents lie in it (none listed when no
        content spells a special token: then nothing needs guarding). Text formats only."""
        text = self.render(messages, add_generation_prompt)
        if self.processor is not None or not self._spells_special(messages):
            return text, []
        plain = text_only(messages)
        marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(plain)]
        pieces = _MARK_RE.split(self.render(marked, add_generation_prompt))
        for shape in (lambda c: c, str.strip):  # verbatim, or trimmed as many templates do
            out, spans = pieces[0], []
            for index, template in zip(pieces[1::2], pieces[2::2]):
                content = shape(plain[int(index)]["content"])
                spans.append((len(out), len(out) + len(content)))
                out += content + template
            if out == text:
                return text, spans
        defused = [{**m, "content": self.defuse(m["content"])} for m in plain]
        return self.render(defused, add_generation_prompt), []  # a template that rewrites content

    def encode_guarded(self, guarded: Guarded) -> list[int]:
        """Token ids of a rendered text: special tokens of the template become their ids, text
        inside the content ``spans`` is tokenized with special-token parsing off."""
        text, spans = guarded
        if not spans or self._special_re is None:
            return self.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in spans):
                continue  # spelled inside a content: ordinary text
            ids += self._plain_ids(text[pos : m.start()]) + [self.special_ids[m.group()]]
            pos = m.end()
        return ids + self._plain_ids(text[pos:])

    def _plain_ids(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def first_messages(self, obs_message: dict[str, Any]) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, obs_message]

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of the first prompt (or a compacted history), ending with the assistant
        generation prompt; contents are never read as special tokens (:meth:`encode_guarded`)."""
        return self.encode_guarded(self.render_guarded(messages, add_generation_prompt=True))

    def prompt_text(self, messages: Sequence[dict[str, Any]]) -> str:
        return self.render(messages, add_generation_prompt=True)

    def _check_prompt_rendered(self) -> None:
        """The template writes the user's text, and the system prompt when one is set: a template that
        drops either trains for hours on prompts without the task (or its instructions)."""
        user, system = "veriloop-user-text-check", "veriloop-system-text-check"
        messages = [{"role": "system", "content": system}] if self.system_prompt else []
        text = self.render([*messages, {"role": "user", "content": user}], add_generation_prompt=True)
        if user not in text:
            raise ValueError(
                "the chat template drops the user message (its text is not in the rendered prompt): "
                "the model would never see the task; fix or replace the tokenizer's chat_template"
            )
        if self.system_prompt and system not in text:
            raise ValueError(
                "the chat template drops the system message (env.system_prompt is not in the rendered "
                "prompt): put the instructions in the task text and set env.system_prompt to null, or fix "
                "the tokenizer's chat_template"
            )

    def _assistant_close(self) -> str:
        """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``)."""
        conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(conv, add_generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError(
                "the chat template does not write the assistant content verbatim; cannot find deltas"
            )
        return text.split(_SENTINEL, 1)[1]

    def _prefix_ids(self) -> list[int]:
        """Token ids of the assistant prefix; an error when it would end the turn it opens."""
        prefix = self.assistant_prefix
        if not prefix:
            return []
        ends = [t for t in (self.eos_text, self.assistant_close.strip()) if t and t in prefix]
        if ends:
            raise ValueError(
                f"env.assistant_prefix {prefix!r} contains {ends[0]!r}, which ends the assistant's turn: "
                "the model would answer an empty turn; remove it from the prefix"
            )
        return self.encode(prefix)

    def action_text(self, sampled_ids: Sequence[int], eos_ids: Sequence[int]) -> str:
        """The text of a sample: decoded, without a final end-of-turn token (a turn's response is
        the assistant prefix and this)."""
        ids = list(sampled_ids)
        if ids and ids[-1] in eos_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def extends(self, conversation: Sequence[dict[str, Any]], new_message: dict[str, Any]) -> bool:
        """Whether the template only appends when ``new_message`` is added: the text of
        ``conversation`` (its last assistant turn closed) is a prefix of the text of
        ``conversation + [new_message]`` with the generation prompt.

        False for templates that rewrite history, e.g. reasoning templates (Qwen3, DeepSeek-R1)
        that drop the ``<think>`` part of earlier assistant turns once a new user message follows;
        the rollout then starts a new training sample (see docs/multi-turn.md).
        """
        before = self.render(conversation, add_generation_prompt=False)
        after = self.render([*conversation, new_message], add_generation_prompt=True)
        return after.startswith(before)

    def delta_ids(
        self, conversation: Sequence[dict[str, Any]], new_message: dict[str, Any], ended_with_eos: bool
    ) -> list[int]:
        """Token ids of :meth:`delta_text` (text formats)."""
        ids = self.delta_ids_or_none(conversation, new_message, ended_with_eos)
        if ids is None:
            self.delta_text(conversation, new_message, ended_with_eos)  # raises, saying why
        assert ids is not None
        return ids

    def delta_ids_or_none(
        self, conversation: Sequence[dict[str, Any]], new_message: dict[str, Any], ended_with_eos: bool
    ) -> list[int] | None:
        """Token ids of :meth:`delta_text_or_none` (text formats), contents never read as special
        tokens; None where the template rewrites history."""
        before = self.render_guarded(conversation, add_generation_prompt=False)[0]
        after, spans = self.render_guarded([*conversation, new_message], add_generation_prompt=True)
        if not after.startswith(before):
            return None
        close = self._close(ended_with_eos)
        shift = len(close) - len(before)
        delta = [(max(a, len(before)) + shift, b + shift) for a, b in spans if b > len(before)]
        return self.encode_guarded((close + after[len(before) :], delta))

    def _close(self, ended_with_eos: bool) -> str:
        """The closing text of the sampled turn still to append (all of it without an end-of-turn)."""
        close = self.assistant_close
        if ended_with_eos and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text) :]
        return close

    def delta_text(
        self, conversation: Sequence[dict[str, Any]], new_message: dict[str, Any], ended_with_eos: bool
    ) -> str:
        """Token ids to append after a sample so the next assistant turn can start.

        Args:
            conversation: The messages so far, ending with the assistant message just sampled.
            new_message: The environment's next (user) message.
            ended_with_eos: Whether the sampled ids end with the end-of-turn token.

        Returns:
            ``missing closing text + new user message + generation prompt``.
        """
        text = self.delta_text_or_none(conversation, new_message, ended_with_eos)
        if text is None:
            raise ValueError(
                "the chat template re-renders earlier turns when a message is added (not prefix-stable), "
                "so token-in/token-out deltas are undefined for it; check ChatFormat.extends first and "
                "start a new sample where it is False (the rollout does)"
            )
        return text

    def delta_text_or_none(
        self, conversation: Sequence[dict[str, Any]], new_message: dict[str, Any], ended_with_eos: bool
    ) -> str | None:
        """:meth:`delta_text`, or None where the template rewrites history (:meth:`extends` is
        False); one rendering of each side, for the rollout's every turn."""
        before = self.render(conversation, add_generation_prompt=False)
        after = self.render([*conversation, new_message], add_generation_prompt=True)
        if not after.startswith(before):
            return None
        return self._close(ended_with_eos) + after[len(before) :]

    def encode_multimodal(self, text: str, images: Sequence[Any]) -> tuple[list[int], dict[str, Any]]:
        """Vision formats: ids of ``text`` with its image placeholders expanded, and the images' inputs.

        Returns:
            (ids, vision inputs such as ``pixel_values`` [len(images), C, H, W]; empty without images).
        """
        from veriloop.agents.vision import to_pil, vision_inputs

        pil = [to_pil(im) for im in images] or None
        out = self.processor(text=text, images=pil, return_tensors="pt", add_special_tokens=False)
        return out["input_ids"][0].tolist(), (vision_inputs(dict(out)) if pil else {})
