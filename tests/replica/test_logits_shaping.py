"""Bias, penalties, min_tokens and stop token ids in the engine: speculation and resumes leave
the output exactly as plain decoding gives it, and stop conditions wait for min_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.migration import resumed_request
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Detokenize, Engine, ProposerKind, ends_a_stop
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from replica.spec.draft import load_draft_vocab
from tests.replica.engine_runs import load_detokenizer, run

MAX_TOKENS = 24
PROMPT_TEXT = "def add(a, b):\n    return a + b\n"
SHAPINGS = {
    "frequency": {"frequency_penalty": 1.5},
    "presence+repetition": {"presence_penalty": 1.0, "repetition_penalty": 1.3},
    "bias": {"logit_bias": ((67, -100.0), (92, 4.0))},  # "_" never, "x" more often
    "min_tokens": {"min_tokens": 12, "stop_token_ids": (203,)},  # no "\\n" before 12 tokens
    "allowed": {"allowed_token_ids": (92, 203, 225, 12, 13, 16)},  # x \n space ( ) :
}


@pytest.fixture(scope="module")
def prompt(target_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(PROMPT_TEXT).ids


@pytest.fixture(scope="module")
def runners(target_dir: Path, draft_dir: Path) -> dict[str, tuple[ModelRunner, ModelRunner]]:
    target = ModelRunner(target_dir, num_blocks=64)
    cut = ModelRunner(draft_dir, num_blocks=64, head_vocab=load_draft_vocab(draft_dir))
    return {"whole": (target, ModelRunner(draft_dir, num_blocks=64)), "cut": (target, cut)}


def best_effort(prompt: list[int], **sampling: object) -> Request:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, **sampling})  # type: ignore[arg-type]
    return Request("q", prompt, params, tier=Tier.BEST_EFFORT)


@pytest.mark.parametrize("shaping", SHAPINGS)
@pytest.mark.parametrize("sampled", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_speculation_keeps_shaped_output_exactly(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    prompt: list[int],
    shaping: str,
    sampled: dict[str, object],
) -> None:
    """Each verify row is shaped as if its proposal had been decoded one by one, so drafts
    (whole or cut head) and n-grams at any k give the plain output."""
    request = best_effort(prompt, **SHAPINGS[shaping], **sampled)
    plain, _ = run(Engine(*runners["whole"]), request, [0])
    unshaped, _ = run(Engine(*runners["whole"]), best_effort(prompt, **sampled), [0])
    assert plain != unshaped
    cases: list[tuple[str, ProposerKind]] = [
        ("whole", "draft"),
        ("cut", "draft"),
        ("whole", "ngram"),
    ]
    for pair, proposer in cases:
        engine = Engine(*runners[pair], proposer=proposer)
        assert run(engine, request, [3, 1, 5])[0] == plain, (pair, proposer)


def test_a_resumed_request_is_shaped_as_where_it_began(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    """Penalties count the output a resume turned into prompt; min_tokens counts what is
    left. Without that accounting the resumed output differs."""
    engine = Engine(*runners["whole"], proposer="draft")
    original = best_effort(prompt, frequency_penalty=1.5, presence_penalty=0.5, min_tokens=12)
    plain, _ = run(engine, original, [0])
    resumed = resumed_request(original, plain[:8])
    assert run(engine, resumed, [2])[0] == plain[8:]
    forgetful = Request("f", resumed.prompt_token_ids, resumed.sampling, tier=Tier.BEST_EFFORT)
    assert run(engine, forgetful, [2])[0] != plain[8:]


def test_min_tokens_holds_back_eos_then_lets_it_end_the_output(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    engine = Engine(*runners["whole"], proposer="draft")
    eos = next(iter(engine.eos_token_ids))
    forced = {"logit_bias": ((eos, 100.0),), "max_tokens": 10}
    assert run(engine, best_effort(prompt, **forced), [3]) == ([eos], FinishReason.STOP)
    out, reason = run(engine, best_effort(prompt, **forced, min_tokens=6), [3])
    assert len(out) == 7 and out[-1] == eos and eos not in out[:-1]
    assert reason is FinishReason.STOP
    ignored, reason = run(engine, best_effort(prompt, **forced, ignore_eos=True), [3])
    assert ignored == [eos] * 10 and reason is FinishReason.LENGTH


def test_a_stop_token_id_ends_the_output_once_min_tokens_are_out(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    engine = Engine(*runners["whole"], proposer="draft")
    plain, _ = run(engine, best_effort(prompt, ignore_eos=True), [0])
    stop_id = plain[4]
    first = plain.index(stop_id)
    out, reason = run(engine, best_effort(prompt, stop_token_ids=(stop_id,)), [3])
    assert (out, reason) == (plain[: first + 1], FinishReason.STOP)
    held, _ = run(engine, best_effort(prompt, stop_token_ids=(stop_id,), min_tokens=8), [3])
    assert len(held) >= 8 and stop_id not in held[:8]


def stop_ends(detok: Detokenize, tokens: list[int], stop: str) -> list[int]:
    """The token counts at which a new match of `stop` ends in the text."""
    counts = [detok(tokens[:n]).count(stop) for n in range(len(tokens) + 1)]
    return [n for n in range(1, len(tokens) + 1) if counts[n] > counts[n - 1]]


def test_stop_strings_wait_for_min_tokens(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int], target_dir: Path
) -> None:
    """As vLLM v1: a stop string ending in the first min_tokens tokens' text does not count;
    the first one ending later does, with the earlier one still in the decoded window."""
    detok = load_detokenizer(target_dir)
    assert detok is not None
    engine = Engine(*runners["whole"], proposer="draft", detokenize=detok)
    plain, _ = run(engine, best_effort(prompt, ignore_eos=True), [0])
    stop = "_"
    ends = stop_ends(detok, plain, stop)
    assert len(ends) >= 2, detok(plain)
    for min_tokens, want in ((0, ends[0]), (ends[0] - 1, ends[0]), (ends[0], ends[1])):
        request = best_effort(prompt, stop=(stop,), min_tokens=min_tokens, ignore_eos=True)
        assert run(engine, request, [3]) == (plain[:want], FinishReason.STOP), min_tokens


def test_a_resumed_request_stops_where_it_would_have(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int], target_dir: Path
) -> None:
    """The output a resume turned into prompt is checked for stop strings only where the
    original was: a match min_tokens exempted there does not end the resumed request."""
    detok = load_detokenizer(target_dir)
    assert detok is not None
    engine = Engine(*runners["whole"], proposer="draft", detokenize=detok)
    plain, _ = run(engine, best_effort(prompt, ignore_eos=True), [0])
    ends = stop_ends(detok, plain, "_")
    original = best_effort(prompt, stop=("_",), min_tokens=ends[0], ignore_eos=True)
    for cut in range(1, ends[1] - 1):
        resumed = resumed_request(original, plain[:cut])
        assert run(engine, resumed, [2]) == (plain[cut : ends[1]], FinishReason.STOP), cut


@pytest.mark.parametrize(("text", "stop"), [("aé bb", "é"), ("xx 日本 yy", "本"), ("abc… d", "…")])
def test_a_stop_string_ending_in_a_split_character_ends_in_the_token_completing_it(
    target_dir: Path, text: str, stop: str
) -> None:
    """Byte-level tokens can split a character: the text without the completing token ends in
    U+FFFD, which must not hide a match ending in that character."""
    from tokenizers import Tokenizer

    detok = load_detokenizer(target_dir)
    assert detok is not None
    tokens = Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(text).ids
    want = next(n for n in range(1, len(tokens) + 1) if stop in detok(tokens[:n]))
    assert detok(tokens[: want - 1]).endswith("\ufffd")
    counts = range(1, len(tokens) + 1)
    anywhere = [ends_a_stop(detok, tokens[:n], (stop,), only_last=False) for n in counts]
    assert anywhere == [n >= want for n in counts]
    in_last = [ends_a_stop(detok, tokens[:n], (stop,), only_last=True) for n in counts]
    assert in_last == [n == want for n in counts]


def test_a_piece_of_a_character_ends_no_stop_string(target_dir: Path) -> None:
    """A token ending inside a character, or a window starting inside one, decodes a U+FFFD
    the client never sees: a stop string holding one matches nothing (it used to stop the
    output at the piece), and one ending before the piece still matches."""
    from tokenizers import Tokenizer

    detok = load_detokenizer(target_dir)
    assert detok is not None
    tokens = Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode("中文😀é").ids
    assert any(detok(tokens[:n]).endswith("\ufffd") for n in range(1, len(tokens)))
    assert any(detok(tokens[n:]).startswith("\ufffd") for n in range(1, len(tokens)))
    for only_last in (False, True):
        for start in range(len(tokens)):
            for end in range(start + 1, len(tokens) + 1):
                window = tokens[start:end]
                for stop in ("\ufffd", "文\ufffd", "\ufffd\ufffd"):
                    assert not ends_a_stop(detok, window, (stop,), only_last), (start, end, stop)
    ends = [ends_a_stop(detok, tokens[:n], ("文",), True) for n in range(1, len(tokens) + 1)]
    assert ends.count(True) == 1


def test_shaped_and_plain_greedy_requests_share_a_draft_batch(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    """A shaped request takes its batch's drafts out of the fused chain; each request still
    gets its own output."""
    shaped = best_effort(prompt, **SHAPINGS["frequency"])
    plain_alone, _ = run(Engine(*runners["whole"]), best_effort(prompt), [0])
    shaped_alone, _ = run(Engine(*runners["whole"]), shaped, [0])
    engine = Engine(*runners["whole"], proposer="draft")
    requests = [Request("p", prompt, best_effort(prompt).sampling, tier=Tier.BEST_EFFORT)]
    requests.append(Request("s", prompt, shaped.sampling, tier=Tier.BEST_EFFORT))
    for request in requests:
        engine.add_request(request)
    engine.step(BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in requests)))
    while live := [r.request_id for r in requests if engine.finish_reason(r.request_id) is None]:
        engine.step(BatchPlan(tuple(DecodeStep(rid, 3) for rid in live)))
    assert engine.output_token_ids("p") == plain_alone
    assert engine.output_token_ids("s") == shaped_alone


def test_bad_words_never_appear_and_speculation_keeps_the_output(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    """A word's last token is banned where the output (and the proposals a row follows) ends
    with the rest of it; a one-token word is banned everywhere. Resumed output counts."""
    plain, _ = run(Engine(*runners["whole"]), best_effort(prompt), [0])
    pair, single = tuple(plain[3:5]), (plain[0],)
    request = best_effort(prompt, bad_words=(pair, single))
    shaped, _ = run(Engine(*runners["whole"]), request, [0])
    assert shaped != plain and single[0] not in shaped
    assert all(tuple(shaped[i : i + 2]) != pair for i in range(len(shaped) - 1))
    for name, proposer in (("whole", "draft"), ("cut", "draft"), ("whole", "ngram")):
        engine = Engine(*runners[name], proposer=proposer)
        assert run(engine, request, [3, 1, 5])[0] == shaped, (name, proposer)
    cut = next((i for i in range(1, len(shaped)) if shaped[i - 1] == pair[0]), 4)
    resumed = resumed_request(request, shaped[:cut])
    assert run(Engine(*runners["whole"], proposer="draft"), resumed, [2])[0] == shaped[cut:]
