"""Prompt text for real runs on the demo pair: held-out Python source cut to exact token counts.

The demo models were trained on the standard library's source; their training script holds out a
stable 5% of files (deploy/models/train_demo.py: read_split / is_heldout). Prompts come from
those held-out files, so the target sees text like its training data but not the data itself,
and the draft's acceptance rate is what unseen code gives.

A prompt of n tokens is a random window of n tokens of the held-out stream, decoded to text and
re-encoded: the server tokenizes the text again, so the length that counts is the re-encoded
one. Windows that do not survive the round trip (a cut inside a multi-byte character) are
retried elsewhere. Lengths arrive already scaled for CPU: WorkloadConfig.length_scale shrinks
the workload's prompt (and output) lengths before they are asked for here, so the planner, the
records and the prompts all agree on one length.

A session's later round (PromptSource.after_output) starts with the round before's prompt and
the output the server gave it, as an agent sends its history back, then fresh text.
"""

from __future__ import annotations

import importlib.util
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "models" / "train_demo.py"
DOCUMENT_SEPARATOR = "\n\n"
ATTEMPTS = 64


def demo_training_script() -> ModuleType:
    """The demo training script as a module (deploy/ is not a package, so load it by path)."""
    name = "slos_serve_train_demo"
    if name in sys.modules:
        return sys.modules[name]
    if not TRAIN_SCRIPT.is_file():
        raise ValueError(f"demo training script not found at {TRAIN_SCRIPT}")
    spec = importlib.util.spec_from_file_location(name, TRAIN_SCRIPT)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {TRAIN_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def heldout_texts() -> list[str]:
    """The demo pair's held-out source files (the same split on every machine)."""
    _, heldout = demo_training_script().read_split()
    return list(heldout)


Message = tuple[str, str]
"""A chat message: (role, content)."""


@dataclass(frozen=True)
class Prompt:
    text: str
    """What the model reads: the prompt, or the chat its messages render to."""
    token_ids: tuple[int, ...]
    """The text's tokens as the server will compute them (no special tokens added)."""
    messages: tuple[Message, ...] = ()
    """For a chat endpoint: the messages sent (ChatPromptSource)."""


class Prompts(Protocol):
    """What a run takes its prompts from: plain text (PromptSource) or chats
    (ChatPromptSource)."""

    def prompt(self, num_tokens: int, rng: np.random.Generator | None = None) -> Prompt: ...

    def prompt_after(
        self, prefix: Prompt, num_tokens: int, rng: np.random.Generator | None = None
    ) -> Prompt: ...

    def after_output(
        self, before: Prompt, output: str, history_len: int, num_tokens: int, key: str
    ) -> Prompt: ...

    def round_growth(self) -> int:
        """The fewest tokens a session's next prompt can add to the one before."""
        ...


class PromptSource:
    """Exact-length prompts cut from a corpus; deterministic for a seed."""

    def __init__(self, tokenizer: Tokenizer, texts: Sequence[str], seed: int) -> None:
        if not texts:
            raise ValueError("prompt corpus is empty")
        self.tokenizer = tokenizer
        self.stream = self.encode(DOCUMENT_SEPARATOR.join(texts))
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    @classmethod
    def for_demo(cls, model_dir: str | Path, seed: int) -> PromptSource:
        """Held-out prompts with the demo model's tokenizer (its folder's tokenizer.json)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {str(model_dir)!r}")
        return cls(Tokenizer.from_file(str(path)), heldout_texts(), seed)

    def encode(self, text: str) -> list[int]:
        """The text's tokens as the server computes them (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, num_tokens: int, rng: np.random.Generator | None = None) -> Prompt:
        """A prompt whose text encodes to exactly num_tokens tokens (windows drawn with `rng`,
        else the source's own generator)."""
        rng = rng or self._rng
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        if num_tokens > len(self.stream):
            raise ValueError(
                f"num_tokens={num_tokens} exceeds the prompt corpus ({len(self.stream)} tokens)"
            )
        for _ in range(ATTEMPTS):
            start = int(rng.integers(0, len(self.stream) - num_tokens + 1))
            text = self.tokenizer.decode(self.stream[start : start + num_tokens])
            ids = self.encode(text)
            if len(ids) > num_tokens:
                text = self.tokenizer.decode(ids[:num_tokens])
                ids = self.encode(text)
            if len(ids) == num_tokens:
                return Prompt(text, tuple(ids))
        raise ValueError(f"no window of the corpus round-trips to exactly {num_tokens} tokens")

    def prompt_after(
        self, prefix: Prompt, num_tokens: int, rng: np.random.Generator | None = None
    ) -> Prompt:
        """A prompt of exactly num_tokens tokens whose first tokens are `prefix`'s, text and
        ids alike (a window whose first token would merge with the prefix's last is skipped)."""
        rest = num_tokens - len(prefix.token_ids)
        if rest < 1:
            raise ValueError(
                f"num_tokens={num_tokens} leaves no room after a "
                f"{len(prefix.token_ids)}-token prefix"
            )
        for _ in range(ATTEMPTS):
            tail = self.prompt(rest, rng)
            ids = tuple(self.encode(prefix.text + tail.text))
            if ids == prefix.token_ids + tail.token_ids:
                return Prompt(prefix.text + tail.text, ids)
        raise ValueError(f"no window of the corpus follows the prefix in exactly {rest} tokens")

    def after_output(
        self, before: Prompt, output: str, history_len: int, num_tokens: int, key: str
    ) -> Prompt:
        """A session's next prompt of exactly num_tokens tokens: the round before's prompt and
        the output it got (at most `history_len` tokens of them), then fresh text standing for
        the tool's response. The history is the text as sent back, encoded again, so it is the
        same tokens the server cached unless the encoding differs where prompt and output
        meet (as for any client sending text). The fresh text is drawn with a generator seeded
        by the source's seed and `key`, so a round gets the same response whenever the round
        before ends."""
        _check_history(before, history_len, num_tokens)
        text = before.text + output
        ids = self.encode(text)
        cut = min(len(ids), history_len)
        while len(ids) > history_len:
            text = self.tokenizer.decode(ids[:cut])
            ids = self.encode(text)
            cut -= 1
        return self.prompt_after(Prompt(text, tuple(ids)), num_tokens, self.keyed(key))

    def round_growth(self) -> int:
        """One fresh token (the output may be cut to make room)."""
        return 1

    def keyed(self, key: str) -> np.random.Generator:
        """A generator seeded by the source's seed and `key`: the same draws for a key
        whatever was drawn before."""
        return np.random.default_rng([self.seed, zlib.crc32(key.encode())])


def _check_history(before: Prompt, history_len: int, num_tokens: int) -> None:
    if not len(before.token_ids) <= history_len < num_tokens:
        raise ValueError(
            f"history_len={history_len} must lie in [{len(before.token_ids)}, "
            f"num_tokens={num_tokens})"
        )


class ChatPromptSource:
    """Prompts as chats for a chat endpoint, rendered by the model's chat template to exactly
    the asked tokens: a fresh user message; a shared prefix as the system message (a class's
    system prompt); a session's next round as the chat so far, the output as the assistant's
    message, then the tool's response as a user message. The text of each message comes
    from `source`; each chat's last message is sized so the rendering has the length asked,
    as a server with the same template computes it."""

    def __init__(self, source: PromptSource, render: Callable[[list[dict[str, str]]], str]):
        self.source = source
        self.render = render
        """Messages to the prompt text, with the assistant's turn opened (the server's
        rendering: router.tokenizer.TextCodec.render_chat)."""

    def _rendered(self, messages: Sequence[Message]) -> tuple[str, tuple[int, ...]]:
        text = self.render([{"role": role, "content": content} for role, content in messages])
        return text, tuple(self.source.encode(text))

    def _fill(
        self,
        head: Sequence[Message],
        role: str,
        num_tokens: int,
        rng: np.random.Generator | None,
        bare: int | None = None,
    ) -> Prompt:
        """`head` and one more message of `role`, its content fresh text of the length that
        makes the chat num_tokens tokens (tried again where its edges merge with the
        template's). `bare`: the tokens of the chat with that message empty, when the caller
        rendered it already."""
        if bare is None:
            bare = len(self._rendered([*head, (role, "")])[1])
        want = num_tokens - bare
        if want < 1:
            raise ValueError(
                f"a {num_tokens}-token chat has no room for a {role} message: the chat template "
                f"and the messages before it take {bare} tokens"
            )
        for _ in range(ATTEMPTS):
            messages = (*head, (role, self.source.prompt(want, rng).text))
            text, ids = self._rendered(messages)
            if len(ids) == num_tokens:
                return Prompt(text, ids, messages)
            want = max(1, want + num_tokens - len(ids))
        raise ValueError(f"no {role} message makes the chat exactly {num_tokens} tokens")

    def round_growth(self) -> int:
        """The role markers of the assistant's message and the user's, one token of the
        user's, and one for where the messages meet the markers (the output may be cut to
        make room)."""
        sample: list[Message] = [("user", "x")]
        _, before = self._rendered(sample)
        _, after = self._rendered([*sample, ("assistant", ""), ("user", "")])
        return len(after) - len(before) + 2

    def prompt(self, num_tokens: int, rng: np.random.Generator | None = None) -> Prompt:
        """One user message."""
        return self._fill([], "user", num_tokens, rng)

    def prompt_after(
        self, prefix: Prompt, num_tokens: int, rng: np.random.Generator | None = None
    ) -> Prompt:
        """`prefix`'s one message as the system message, then a user message."""
        if len(prefix.messages) != 1:
            raise ValueError(f"a shared prefix is one message, got {len(prefix.messages)}")
        return self._fill([("system", prefix.messages[0][1])], "user", num_tokens, rng)

    def after_output(
        self, before: Prompt, output: str, history_len: int, num_tokens: int, key: str
    ) -> Prompt:
        """The chat so far, `output` as the assistant's message (cut to the tokens
        `history_len` leaves it past the prompt before, and further while the chat would
        leave no room), then the tool's response as a user message (seeded by `key`)."""
        _check_history(before, history_len, num_tokens)
        kept = self.source.encode(output)
        cut = min(len(kept), history_len - len(before.token_ids))
        reply = output
        while True:
            if cut < len(kept):
                reply = self.source.tokenizer.decode(kept[:cut])
            head = [*before.messages, ("assistant", reply)]
            _, bare = self._rendered([*head, ("user", "")])
            if len(bare) < num_tokens or cut == 0:
                return self._fill(head, "user", num_tokens, self.source.keyed(key), len(bare))
            cut = max(0, cut - (len(bare) - num_tokens + 1))
