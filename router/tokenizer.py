"""Text <-> token ids at the door: encoding, the chat template, incremental decoding.

Built on `tokenizers` and a sandboxed Jinja environment (the way HF renders chat templates),
so the router needs neither torch nor transformers to start (transformers only converts the
tokenizer of a model that ships no tokenizer.json).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import llguidance
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from replica.grammar_vocab import grammar_tokenizer
from replica.model_source import REPLACEMENT_CHAR, eos_token_ids, load_tokenizer, model_dir
from router.errors import BadRequest


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat fields on how the template renders a conversation."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The template's own switches (say a reasoning model's enable_thinking)."""


@dataclass
class TextCodec:
    """One model's tokenizer and chat template."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    """The model's EOS ids (its config's), which structured output needs, as on a replica."""
    model_vocab_size: int | None = None
    """The model's vocabulary size (its config's) when it differs from the tokenizer's."""

    @classmethod
    def from_dir(cls, model: str | Path) -> TextCodec:
        """The tokenizer plus the chat template of an HF folder or hub repo id."""
        root = model_dir(model, weights=False)
        tokenizer = load_tokenizer(root)
        if tokenizer is None:
            raise ValueError(
                f"no tokenizer.json, nor tokenizer files transformers reads, in {root}"
            )
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = root / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else None
        template = template or config.get("chat_template")
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        model_path = root / "config.json"
        model_config = json.loads(model_path.read_text()) if model_path.is_file() else {}
        vocab = model_config.get("vocab_size")
        return cls(
            tokenizer,
            template,
            eos,
            eos_token_ids(root, model_config),
            vocab if isinstance(vocab, int) else None,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Output text skips special tokens (as vLLM's default); a prompt given as ids keeps
        them when echoed or detokenized, so its text matches its tokens."""
        ids = list(token_ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    @cached_property
    def grammar_vocab(self) -> llguidance.LLTokenizer:
        """The vocabulary structured-output grammars are checked against, as a replica builds
        it (a model without EOS cannot drive them there either); built on first use."""
        return grammar_tokenizer(self.tokenizer, self.model_vocab, self.eos_token_ids)

    @property
    def model_vocab(self) -> int:
        """Token ids the model has (its embedding rows; the tokenizer's count without a
        model config)."""
        return self.model_vocab_size or self.vocab_size

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token as the vocabulary spells it: a byte-level piece is one byte, at
        most one character of text, so no token stands for more characters than its spelling
        has (indented code's whitespace tokens can have dozens; a normalizer that drops or
        composes characters, as BERT's or NFC, is the exception)."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))

    def token_text(self, token_id: int) -> str:
        """One token's text for log-probabilities (special tokens by name, as vLLM shows them;
        a piece of a multi-byte character decodes to U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    @cached_property
    def byte_vocab(self) -> llguidance.LLTokenizer | None:
        """The grammar vocabulary, which holds each token's bytes; None for a model without
        EOS, which has none. The front door builds it at its start, off its loop."""
        return self.grammar_vocab if self.eos_token_ids else None

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes for log-probabilities (a special token's name; the text's
        bytes without a `byte_vocab`)."""
        vocab = self.byte_vocab
        if vocab is None or vocab.is_special_token(token_id):
            return self.token_text(token_id).encode()
        return bytes(vocab.decode_bytes([token_id]))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions | None = None,
    ) -> str:
        """The prompt text for chat messages (and the tools offered, for templates that show
        them), ending with the assistant's turn opener, or, to continue the final message,
        right after its text (whatever the template puts after a message is cut)."""
        if not self.chat_template:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages")
        options = options or ChatOptions()
        try:
            text = self._template.render(
                **options.template_kwargs,
                messages=messages,
                tools=tools or None,
                add_generation_prompt=options.add_generation_prompt,
                eos_token=self.eos_token or "",
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # The template's own checks (raise_exception) and its filters on the messages.
            cut = _text_arguments(messages)
            note = f" ({cut} is not a JSON object: the template got it as text)" if cut else ""
            raise BadRequest(
                f"chat template failed on these messages: {exc}{note}", cut or "messages"
            ) from exc
        if options.continue_final_message:
            return _ending_with(text, messages[-1]["content"])
        return text

    @cached_property
    def _template(self) -> Template:
        """The chat template, compiled once: every chat request used to compile it on the
        door's event loop (0.6 ms for the demo's, 13 ms for a 3.6 kB test template)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template or "")

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


def _text_arguments(messages: list[dict[str, Any]]) -> str | None:
    """Where the first earlier call whose arguments are text, not an object, is: a template
    that reads them as an object (iterates them, say) fails on that call."""
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls", ())):
            if isinstance(call["function"]["arguments"], str):
                return f"messages[{i}].tool_calls[{j}].function.arguments"
    return None


def _ending_with(text: str, final: str) -> str:
    """The rendered chat cut right after the final message's text (its spacing kept where the
    template kept it), so the model continues that message."""
    core = final.strip()
    at = text.rfind(core)  # an empty message: the whole text, as HF renders it
    if at < 0:
        raise BadRequest(
            "continue_final_message: the final message's text is not in the rendered chat",
            "messages",
        )
    kept = final.lstrip()
    return text[: at + (len(kept) if text[at : at + len(kept)] == kept else len(core))]


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas that never split a character.

    Byte-level BPE can end a token in the middle of a UTF-8 sequence; decoding it alone yields
    U+FFFD. A delta is released only when the text no longer ends in one, and it is decoded
    with a few tokens of left context so merges across the boundary (leading spaces) are right.
    """

    codec: TextCodec
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new ids; return the text they complete (may be empty)."""
        self.ids.extend(token_ids)
        prefix_text = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.codec.decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text held back at the end (a truncated character stays U+FFFD)."""
        prefix_text = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.codec.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]
