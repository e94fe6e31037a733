"""Speculative decoding: verification rules, proposers, and lossless engine output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from replica import cpu_kernels
from replica.batch import BatchOutcome, BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine, ProposerKind
from replica.kv_cache import KVCacheManager
from replica.model_runner import BLOCK_SIZE, ForwardSeq, ModelRunner
from replica.perf_model import PerfModel
from replica.planner.adaserve import AdaServeConfig, AdaServeTrees, TreeCalibration
from replica.planner.specserve import ConfidenceCalibration, SpecServeLengths
from replica.request import SLO, Request, SamplingParams, Tier
from replica.sampling import position_noise
from replica.spec.draft import (
    DRAFT_VOCAB_FILE,
    DraftJob,
    DraftModel,
    Proposal,
    SampledTreeJob,
    TreeJob,
    load_draft_vocab,
)
from replica.spec.ngram import NgramProposer
from replica.spec.tree import TokenTree
from replica.spec.verify import verify_choices, verify_stochastic, verify_tree_sampled
from tests.replica.engine_runs import load_detokenizer, run

# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CHI2_CRITICAL_DF5 = 20.52


def test_greedy_verification_accepts_the_matching_prefix_plus_one() -> None:
    assert verify_choices([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert verify_choices([4, 9, 6], [4, 5, 6, 7]) == [4, 5]
    assert verify_choices([9], [3, 8]) == [3]
    assert verify_choices([], [3]) == [3]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _verify_many(
    target: torch.Tensor, draft: torch.Tensor | None, trials: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first output token, and of the second where one was produced."""
    gen = torch.Generator().manual_seed(1234)
    vocab = target.shape[1]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    fixed = torch.tensor([2, 4])
    for _ in range(trials):
        if draft is None:
            proposal, q = fixed.tolist(), None
        else:
            proposal = torch.multinomial(draft, 1, generator=gen).view(-1).tolist()
            q = draft
        out = verify_stochastic(proposal, q, target, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


TARGET = torch.tensor(
    [
        [0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
        [0.10, 0.30, 0.05, 0.25, 0.10, 0.20],
        [0.15, 0.15, 0.20, 0.20, 0.15, 0.15],
    ]
)
DRAFT = torch.tensor(
    [
        [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
        [0.25, 0.05, 0.30, 0.05, 0.30, 0.05],
    ]
)


@pytest.mark.parametrize("draft", [DRAFT, None], ids=["draft-model", "point-mass"])
def test_stochastic_verification_preserves_the_target_distribution(
    draft: torch.Tensor | None,
) -> None:
    first, second = _verify_many(TARGET, draft, trials=6000)
    assert _chi_square(first, TARGET[0]) < CHI2_CRITICAL_DF5
    assert second.sum() > 300
    assert _chi_square(second, TARGET[1]) < CHI2_CRITICAL_DF5


TREE_FIRST = torch.tensor([0.1, 0.4, 0.3, 0.2])
"""The target's first-token distribution; the second's depends on the first (TREE_SECOND)."""
TREE_SECOND = torch.tensor(
    [[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.0, 0.5]]
)
TREE_DRAFT_FIRST = torch.tensor([0.25, 0.1, 0.6, 0.05])
TREE_DRAFT_SECOND = torch.tensor(
    [[0.4, 0.2, 0.2, 0.2], [0.3, 0.3, 0.3, 0.1], [0.1, 0.7, 0.1, 0.1], [0.2, 0.2, 0.2, 0.4]]
)


def test_a_sampled_tree_verifies_to_the_targets_distribution() -> None:
    """A tree shaped before its draws (three children of the root, the first with two of its
    own), each node's children drawn independently from the draft's distribution there: the
    first token is distributed as the target's, and the second, given the first, as the
    target's after it (chi-square at p = 0.001)."""
    gen = torch.Generator().manual_seed(7)
    first = torch.zeros(4)
    second = torch.zeros(4, 4)
    for _ in range(6000):
        tree = TokenTree([0, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 1, 1], [1.0] * 6)
        roots = torch.multinomial(TREE_DRAFT_FIRST, 3, True, generator=gen).tolist()
        for child, token in zip((1, 2, 3), roots, strict=True):
            tree.tokens[child] = token
        below = torch.multinomial(TREE_DRAFT_SECOND[roots[0]], 2, True, generator=gen).tolist()
        tree.tokens[4], tree.tokens[5] = below
        target = torch.stack([TREE_FIRST] + [TREE_SECOND[tree.tokens[i]] for i in range(1, 6)])
        draws = {0: TREE_DRAFT_FIRST, 1: TREE_DRAFT_SECOND[roots[0]]}
        accepted, tokens = verify_tree_sampled(tree, target, draws, gen)
        assert tokens[: len(accepted)] == [tree.tokens[i] for i in accepted]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[0], tokens[1]] += 1
    assert _chi_square(first, TREE_FIRST) < CHI2_CRITICAL_DF5
    for x in range(4):
        seen = second[x][TREE_SECOND[x] > 0]
        if seen.sum() > 200:
            assert _chi_square(seen, TREE_SECOND[x][TREE_SECOND[x] > 0]) < CHI2_CRITICAL_DF5
    assert second.sum() > 1000, "the first child was often accepted and its children tried"
    with pytest.raises(ValueError, match="no draft distribution"):
        verify_tree_sampled(TokenTree([0, 1], [-1, 0], [1.0, 1.0]), target[:2], {}, gen)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert proposer.propose([5, 6, 7, 5], 4) == [6, 7, 5]
    assert proposer.propose([1, 2, 3], 2) == []
    assert proposer.propose([1, 2, 1], 0) == []


TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The cat sat on the mat. The cat sat on the",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "Once upon a time",
]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def prompts(target_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


def _engine(runners: tuple[ModelRunner, ModelRunner], proposer: ProposerKind | None) -> Engine:
    target, draft = runners
    return Engine(target, draft, proposer=proposer)


def _generate(engine: Engine, prompts: list[list[int]], ks: list[int]) -> list[list[int]]:
    """Prefill all prompts in one step, then decode with per-request k until all finish."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        engine.add_request(Request(rid, p, params, tier=Tier.BEST_EFFORT))
    engine.step(
        BatchPlan(tuple(PrefillChunk(r, len(p)) for r, p in zip(ids, prompts, strict=True)))
    )
    while live := [(r, k) for r, k in zip(ids, ks, strict=True) if not engine.finish_reason(r)]:
        outcome = engine.step(BatchPlan(tuple(DecodeStep(r, k) for r, k in live)))
        for o in outcome.outcomes:
            assert 1 <= len(o.new_token_ids) <= o.num_draft_tokens + 1
    outputs = [engine.output_token_ids(r) for r in ids]
    for r in ids:
        engine.abort(r)
    assert engine.num_free_blocks == engine.cache.num_blocks
    return outputs


@pytest.fixture(scope="module")
def baseline(runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]) -> list[list[int]]:
    return _generate(_engine(runners, None), prompts, [0] * len(prompts))


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_greedy_equals_plain_greedy(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
    proposer: ProposerKind,
    k: int,
) -> None:
    assert _generate(_engine(runners, proposer), prompts, [k] * len(prompts)) == baseline


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_mixed_k_in_one_batch_equals_plain_greedy(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
    proposer: ProposerKind,
) -> None:
    engine = _engine(runners, proposer)
    assert _generate(engine, prompts, [0, 3, 7, 1]) == baseline


def test_draft_cache_holds_only_accepted_tokens(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    engine = _engine(runners, "draft")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("a", prompts[0], params, tier=Tier.BEST_EFFORT))
    engine.step(BatchPlan((PrefillChunk("a", len(prompts[0])),)))
    assert engine.draft is not None
    for _ in range(3):
        outcome = engine.step(BatchPlan((DecodeStep("a", 4),))).outcomes[0]
        known = len(prompts[0]) + len(engine.output_token_ids("a"))
        assert outcome.num_computed_tokens == known - 1
        assert engine.cache.num_tokens("a") == known - 1
        assert engine.draft.cache.num_tokens("a") <= known - 1
    engine.abort("a")


def test_the_draft_prefills_with_the_target(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    """Each prefill chunk reaches the draft's cache in the same step, so a request's first
    proposal only feeds the token sampled since."""
    engine = _engine(runners, "draft")
    assert engine.draft is not None
    prompt = prompts[2]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("a", prompt, params, tier=Tier.BEST_EFFORT))
    half = len(prompt) // 2
    outcome = engine.step(BatchPlan((PrefillChunk("a", half),)))
    assert engine.draft.cache.num_tokens("a") == half
    assert outcome.draft_s > 0
    engine.step(BatchPlan((PrefillChunk("a", len(prompt) - half),)))
    assert engine.draft.cache.num_tokens("a") == len(prompt)
    engine.step(BatchPlan((DecodeStep("a", 3),)))
    assert engine.draft.cache.num_tokens("a") <= engine.cache.num_tokens("a")
    engine.abort("a")
    assert engine.draft.cache.num_free_blocks == engine.draft.cache.num_blocks


def test_a_prefill_the_draft_cache_cannot_hold_is_refused(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]]
) -> None:
    engine = Engine(
        ModelRunner(target_dir, num_blocks=16),
        ModelRunner(draft_dir, num_blocks=1),
        proposer="draft",
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("a", prompts[0], params, tier=Tier.BEST_EFFORT))
    assert len(prompts[0]) > 16
    with pytest.raises(ValueError, match="draft KV blocks"):
        engine.step(BatchPlan((PrefillChunk("a", len(prompts[0])),)))
    assert engine.cache.num_tokens("a") == 0 and engine.num_computed_tokens("a") == 0
    engine.step(BatchPlan((PrefillChunk("a", 16),)))
    assert engine.num_computed_tokens("a") == 16


def test_a_stop_string_inside_accepted_drafts_ends_output_as_without_them(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]], target_dir: Path
) -> None:
    detok = load_detokenizer(target_dir)
    assert detok is not None
    engine = Engine(*runners, proposer="draft", detokenize=detok)
    plain = _generate(_engine(runners, None), prompts[:1], [0])[0]
    stop = detok(plain)[len(detok(plain[:5])) - 1 :][:3]
    want = next(n for n in range(1, len(plain) + 1) if stop in detok(plain[:n]))
    assert want < MAX_TOKENS
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,), ignore_eos=True)
    engine.add_request(Request("s", prompts[0], params, tier=Tier.BEST_EFFORT))
    engine.step(BatchPlan((PrefillChunk("s", len(prompts[0])),)))
    while engine.finish_reason("s") is None:
        engine.step(BatchPlan((DecodeStep("s", 4),)))
    assert engine.output_token_ids("s") == plain[:want]
    assert engine.finish_reason("s") is FinishReason.STOP
    engine.abort("s")


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_seeded_sampling_gives_the_same_tokens_at_any_speculation_length(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]], proposer: ProposerKind
) -> None:
    """Speculating or not, k = 1..5 varying step by step, or resumed elsewhere with its output
    as prompt (a migration): a seed fixes the tokens."""
    engine = _engine(runners, proposer)

    def run(rid: str, seed: int, ks: list[int], prompt: list[int] = prompts[1]) -> list[int]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, ignore_eos=True)
        engine.add_request(Request(rid, prompt, params, tier=Tier.BEST_EFFORT))
        engine.step(BatchPlan((PrefillChunk(rid, len(prompt)),)))
        step = 0
        while engine.finish_reason(rid) is None:
            engine.step(BatchPlan((DecodeStep(rid, ks[step % len(ks)]),)))
            step += 1
        out = engine.output_token_ids(rid)
        engine.abort(rid)
        assert len(out) == MAX_TOKENS
        return out

    plain = run("a", 3, [0])
    assert run("b", 3, [3]) == plain
    assert run("c", 3, [1, 5, 2, 0, 4]) == plain
    assert plain[5:] == run("d", 3, [2], prompts[1] + plain[:5])[: MAX_TOKENS - 5]
    assert run("e", 4, [3]) != plain


@pytest.fixture(scope="module")
def cut_runners(
    runners: tuple[ModelRunner, ModelRunner], draft_dir: Path
) -> tuple[ModelRunner, ModelRunner]:
    vocab = load_draft_vocab(draft_dir)
    assert vocab is not None and len(vocab) < runners[0].vocab_size
    return runners[0], ModelRunner(draft_dir, num_blocks=64, head_vocab=vocab)


def test_a_draft_with_a_cut_head_keeps_greedy_output(
    cut_runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
) -> None:
    assert _generate(_engine(cut_runners, "draft"), prompts, [3, 1, 5, 2]) == baseline


def test_a_cut_head_proposes_inside_its_vocabulary_with_full_distributions(
    cut_runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    draft = DraftModel(cut_runners[1])
    head = cut_runners[1].head_vocab
    assert head is not None
    jobs = [
        DraftJob("g", prompts[0], 4, SamplingParams(max_tokens=8), torch.Generator()),
        DraftJob(
            "s",
            prompts[1],
            4,
            SamplingParams(max_tokens=8, temperature=1.0),
            torch.Generator().manual_seed(1),
        ),
        DraftJob(
            "d",
            prompts[2],
            4,
            SamplingParams(max_tokens=8, temperature=1.0, seed=1),
            torch.Generator(),
            position_noise(1, len(prompts[2]), 4, cut_runners[1].vocab_size),
        ),
    ]
    inside = set(head.tolist())
    greedy, sampled, seeded = draft.propose(jobs)
    assert greedy.probs is None and set(greedy.tokens) <= inside
    assert seeded.probs is None and set(seeded.tokens) <= inside and len(seeded.tokens) == 4
    assert set(sampled.tokens) <= inside
    assert sampled.probs is not None and sampled.probs.shape == (4, cut_runners[1].vocab_size)
    off = torch.ones(cut_runners[1].vocab_size, dtype=torch.bool)
    off[head] = False
    assert torch.all(sampled.probs[:, off] == 0)
    assert torch.allclose(sampled.probs.sum(dim=-1), torch.ones(4))


def test_malformed_draft_vocabulary_names_the_file(tmp_path: Path) -> None:
    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"token_ids": ["a"]}')
    with pytest.raises(ValueError, match=r"draft_vocab\.json"):
        load_draft_vocab(tmp_path)
    assert load_draft_vocab(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def transformers_target(target_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("proposer", "sampling"),
    [
        ("draft", {}),
        ("ngram", {}),
        ("draft", {"temperature": 0.9, "seed": 7}),
        ("draft", {"temperature": 0.9, "top_k": 5}),
        ("draft", {"stop": ("e",)}),
        ("draft", {"frequency_penalty": 1.5, "logit_bias": ((25, 4.0),), "min_tokens": 4}),
    ],
)
def test_logprobs_come_from_the_target_at_any_speculation_length(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    target_dir: Path,
    transformers_target: torch.nn.Module,
    proposer: ProposerKind,
    sampling: dict[str, object],
) -> None:
    """Each token's log-probability and its top alternatives are the target's raw ones (before
    temperature, top-k, bias and penalties), from the row that produced the token, whether it
    was drafted and verified, cut short by a stop, or decoded alone: equal to a plain
    transformers forward over prompt + output."""
    prompt = prompts[0]
    detok = load_detokenizer(target_dir)
    for k in (0, 4):
        engine = Engine(*runners, proposer=proposer, detokenize=detok)
        params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=3, **sampling)
        engine.add_request(Request("l", prompt, params, tier=Tier.BEST_EFFORT))
        step = engine.step(BatchPlan((PrefillChunk("l", len(prompt)),)))
        logprobs = step.outcomes[0].logprobs
        while engine.finish_reason("l") is None:
            logprobs += engine.step(BatchPlan((DecodeStep("l", k),))).outcomes[0].logprobs
        tokens = engine.output_token_ids("l")
        engine.abort("l")
        assert len(logprobs) == len(tokens)
        with torch.no_grad():
            logits = transformers_target(torch.tensor([prompt + tokens])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        for i, token in enumerate(tokens):
            got = logprobs[i]
            assert got.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
            assert [t for t, _ in got.top] == expected[i].topk(3).indices.tolist()
            assert got.top[0][1] == pytest.approx(expected[i].max().item(), abs=1e-4)


@pytest.mark.parametrize("chunk", [3, 64])
def test_prompt_logprobs_come_once_from_every_prompt_position(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    transformers_target: torch.nn.Module,
    chunk: int,
) -> None:
    """Prompt token i's log-probability given tokens < i (its rank and top alternatives), from
    the prefill's own rows, whatever the chunking; a preemption before the first token
    recomputes none twice; they come once, with the first token."""
    prompt = prompts[2]
    engine = Engine(*runners, proposer="draft")
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    engine.add_request(Request("p", prompt, params, tier=Tier.BEST_EFFORT))
    reported = []
    for start in range(0, len(prompt), chunk):
        size = min(chunk, len(prompt) - start)
        outcome = engine.step(BatchPlan((PrefillChunk("p", size),))).outcomes[0]
        reported.append(outcome.prompt_logprobs)
        if start == 0 and size < len(prompt):
            engine.preempt("p")
            engine.step(BatchPlan((PrefillChunk("p", size),)))
    while engine.finish_reason("p") is None:
        reported.append(engine.step(BatchPlan((DecodeStep("p", 2),))).outcomes[0].prompt_logprobs)
    engine.abort("p")
    first_token_step = -(-len(prompt) // chunk) - 1
    assert all(not r for i, r in enumerate(reported) if i != first_token_step)
    got = reported[first_token_step]
    with torch.no_grad():
        logits = transformers_target(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits[:-1], dim=-1)
    assert len(got) == len(prompt) - 1
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(expected[i, prompt[i + 1]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == expected[i].topk(2).indices.tolist()
        likelier = (expected[i] > expected[i, prompt[i + 1]] + 1e-4).sum().item()
        assert (
            likelier + 1
            <= lp.rank
            <= (expected[i] > expected[i, prompt[i + 1]] - 1e-4).sum().item() + 1
        )


COSTLY_VERIFY = PerfModel.synthetic({"const": 0.001, "tokens": 0.01})
"""A verify token costs ten steps' overhead: SpecServe keeps only drafts the draft is sure of."""


def _specserve_engine(runners: tuple[ModelRunner, ModelRunner]) -> Engine:
    target, draft = runners
    return Engine(target, draft, proposer="draft", specserve=SpecServeLengths(COSTLY_VERIFY))


def _verified(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The drafts each of the engine's later steps verifies (appended as they run)."""
    verified: list[int] = []
    step = engine.step

    def counting(plan: BatchPlan) -> BatchOutcome:
        outcome = step(plan)
        verified.extend(o.num_draft_tokens for o in outcome.outcomes)
        return outcome

    monkeypatch.setattr(engine, "step", counting)
    return verified


@pytest.mark.parametrize("chained", [True, False], ids=["c-chain", "python-loop"])
def test_specserve_keeps_greedy_output_and_verifies_fewer_drafts(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
    chained: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drafts cut short by the drafter's floor and the verifier's trim change no greedy token,
    on the fused C chain and on the Python loop (which a shaped request takes)."""
    if not chained:
        monkeypatch.setattr(runners[1], "can_chain", lambda _q: False)
    plain, specserve = _engine(runners, "draft"), _specserve_engine(runners)
    counts = {
        name: _verified(e, monkeypatch) for name, e in (("plain", plain), ("spec", specserve))
    }
    assert _generate(plain, prompts, [6] * len(prompts)) == baseline
    assert _generate(specserve, prompts, [6] * len(prompts)) == baseline
    assert sum(counts["spec"]) < sum(counts["plain"]), "nothing was cut"


def test_specserve_keeps_a_seeds_tokens(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    """A seeded request's verify reuses the drafter's noise rows, cut to the drafts kept."""
    outputs = []
    for engine, ks in ((_engine(runners, None), [0]), (_specserve_engine(runners), [5])):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True)
        outputs.append(run(engine, Request("s", prompts[2], params, tier=Tier.BEST_EFFORT), ks)[0])
    assert outputs[0] == outputs[1]


def test_specserve_verifies_every_draft_of_an_unseeded_sampled_request(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its drafts are judged against the draft's probability of the token drawn: dropping the
    unlikely ones would skew its samples, so the verifier keeps what the drafter made (the
    greedy request beside it is cut), and they calibrate apart from greedy drafts."""
    engine = _specserve_engine(runners)
    assert engine.draft is not None
    made: dict[str, list[int]] = {"u": [], "g": []}
    propose = engine.draft.propose

    def recording(jobs: list[DraftJob]) -> list[Proposal]:
        proposals = propose(jobs)
        for job, proposal in zip(jobs, proposals, strict=True):
            made[job.request_id].append(len(proposal.tokens))
        return proposals

    monkeypatch.setattr(engine.draft, "propose", recording)
    verified: dict[str, list[int]] = {"u": [], "g": []}
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, params in (("u", sampled), ("g", greedy)):
        engine.add_request(Request(rid, prompts[2], params, tier=Tier.BEST_EFFORT))
        engine.step(BatchPlan((PrefillChunk(rid, len(prompts[2])),)))
    while live := [rid for rid in "ug" if engine.finish_reason(rid) is None]:
        outcome = engine.step(BatchPlan(tuple(DecodeStep(rid, 5) for rid in live)))
        for o in outcome.outcomes:
            if o.num_draft_tokens:
                verified[o.request_id].append(o.num_draft_tokens)
    assert verified["u"] == made["u"] and len(engine.output_token_ids("u")) == MAX_TOKENS
    assert sum(verified["g"]) < sum(made["g"])
    # Each kind of draft teaches its own calibration (10 bins of prior weight 4 each).
    assert engine.specserve is not None
    for calibration in (engine.specserve.greedy, engine.specserve.sampled):
        assert sum(calibration.judged) > 40


def test_a_chain_stopped_early_caches_only_what_it_wrote(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    """The C chain reserves k - 1 draft slots; stopped at its floor it wrote fewer, and the
    draft cache must not claim the rest (the next proposal would skip a token's KV)."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the draft proposes in the Python loop")
    draft = DraftModel(runners[1])
    prompt = prompts[0]
    draft.prefill([("a", prompt[:-1])])
    assert runners[1].can_chain([1]), "the C chain drafts this job"
    params, rng = SamplingParams(max_tokens=20), torch.Generator()
    job = DraftJob("a", prompt, 8, params, rng, calibration=ConfidenceCalibration(), floor=0.99)
    (proposal,) = draft.propose([job])
    assert 1 <= len(proposal.tokens) < 8
    assert draft.cache.num_tokens("a") == len(prompt) + len(proposal.tokens) - 1


def test_specserve_needs_the_draft_models_confidences(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    with pytest.raises(ValueError, match="specserve needs the draft model's confidences"):
        Engine(runners[0], proposer="ngram", specserve=SpecServeLengths(COSTLY_VERIFY))


def _adaserve_engine(runners: tuple[ModelRunner, ModelRunner], now: float = 0.0) -> Engine:
    target, draft = runners
    trees = AdaServeTrees(COSTLY_VERIFY, clock=lambda: now)
    return Engine(target, draft, proposer="draft", adaserve=trees)


def _calls(owner: object, name: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The first argument of every call to `owner.name` (the batch, the jobs), which still
    runs."""
    calls: list[Any] = []
    method = getattr(owner, name)

    def recording(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(first)
        return method(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def _request_ids(calls: list[list[TreeJob] | list[SampledTreeJob]]) -> set[str]:
    return {job.request_id for jobs in calls for job in jobs}


@pytest.mark.parametrize("k", [2, 4, 6])
def test_adaserve_trees_keep_greedy_output(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
    k: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token trees verified by the target's own choices give plain greedy output, accepted
    paths off the first chain included (their KV moved after the context)."""
    engine = _adaserve_engine(runners)
    moves = _calls(engine.target, "move_kv", monkeypatch)
    verified = _verified(engine, monkeypatch)
    assert _generate(engine, prompts, [k] * len(prompts)) == baseline
    assert 0 < sum(verified) <= k * len(verified)
    if k >= 4:
        assert moves, "no accepted path left the first chain"


def test_adaserve_trees_past_the_cpu_kernels_keep_greedy_output(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trees of 6 children a level and up to 24 nodes a request (AdaServeConfig, as a cluster
    config's `adaserve` sets it): wider than the C beam grows and larger than a C verify row
    takes, they run on the general path, with plain greedy output."""
    target, draft = runners
    trees = AdaServeTrees(COSTLY_VERIFY, AdaServeConfig(max_width=6, max_nodes=24))
    engine = Engine(target, draft, proposer="draft", adaserve=trees)
    shapes: list[tuple[int, int]] = []
    shape = trees.shape
    monkeypatch.setattr(trees, "shape", lambda *args: shapes.append(shape(*args)) or shapes[-1])
    verified = _verified(engine, monkeypatch)
    assert _generate(engine, prompts, [24] * len(prompts)) == baseline
    assert max(width for _, width in shapes) == 6 and max(verified) > 15


def test_adaserve_grows_trees_for_unseeded_requests_and_seeded_ones_keep_chains(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In one batch the greedy request verifies beam trees, the unseeded sampled one (with a
    logit bias) trees whose tokens the draft drew, and the seeded one its planned chains,
    drawn with its positions' noise, which keeps its tokens those it draws alone."""
    engine = _adaserve_engine(runners)
    assert engine.draft is not None
    grown = _calls(engine.draft, "propose_trees", monkeypatch)
    drawn = _calls(engine.draft, "propose_sampled_trees", monkeypatch)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True)
    banned = 203
    biased = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, logit_bias=((banned, -100.0),), ignore_eos=True
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    params = {"g": greedy, "s": seeded, "u": biased}
    for rid, p in params.items():
        engine.add_request(Request(rid, prompts[2], p, tier=Tier.BEST_EFFORT))
    engine.step(BatchPlan(tuple(PrefillChunk(rid, len(prompts[2])) for rid in params)))
    k = 4
    while live := [rid for rid in params if engine.finish_reason(rid) is None]:
        outcome = engine.step(BatchPlan(tuple(DecodeStep(rid, k) for rid in live)))
        for o in outcome.outcomes:
            if o.request_id == "s":
                left = MAX_TOKENS - len(engine.output_token_ids(o.request_id))
                assert o.num_draft_tokens == min(k, left + len(o.new_token_ids) - 1)
    assert _request_ids(grown) == {"g"} and _request_ids(drawn) == {"u"}
    assert len(engine.output_token_ids("u")) == MAX_TOKENS
    assert banned not in engine.output_token_ids("u")
    plain = run(
        _engine(runners, None), Request("p", prompts[2], seeded, tier=Tier.BEST_EFFORT), [0]
    )
    assert engine.output_token_ids("s") == plain[0]


def test_adaserve_gives_the_late_request_the_nodes(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    """Two requests, a step budget of 2 x 3 drafts: the one behind its SLO line gets its
    tokens' worth first, the one ahead of it only what is left (deadline semantics)."""
    engine = _adaserve_engine(runners, now=100.0)
    slo = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("late", prompts[0], params, slo, arrival_time=90.0))
    engine.add_request(Request("early", prompts[0], params, slo, arrival_time=99.9))
    engine.step(BatchPlan(tuple(PrefillChunk(r, len(prompts[0])) for r in ("late", "early"))))
    outcome = engine.step(BatchPlan((DecodeStep("early", 3), DecodeStep("late", 3))))
    drafted = {o.request_id: o.num_draft_tokens for o in outcome.outcomes}
    assert drafted["late"] > drafted["early"]
    assert drafted["late"] + drafted["early"] <= 6
    # The draft grew 3 levels for both; each verify judged its walk, not every node.
    assert (outcome.draft_steps, outcome.draft_batch) == (3, 2)
    for o in outcome.outcomes:
        if o.num_draft_tokens:
            assert o.num_judged_drafts is not None
            assert o.num_accepted_tokens <= o.num_judged_drafts <= o.num_accepted_tokens + 1


def test_adaserve_trees_the_draft_cache_cannot_hold_fall_back_to_chains(
    target_dir: Path,
    draft_dir: Path,
    prompts: list[list[int]],
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The smallest draft pool the chains run in: the steps it cannot hold the trees in run
    the planned chains, and the output stays greedy's."""
    k = 4
    target = ModelRunner(target_dir, num_blocks=64)
    room = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    while True:
        draft = ModelRunner(draft_dir, num_blocks=room)
        try:
            _generate(Engine(target, draft, proposer="draft"), prompts, [k] * len(prompts))
            break
        except ValueError:
            room += 1
    engine = Engine(target, draft, proposer="draft", adaserve=AdaServeTrees(COSTLY_VERIFY))
    assert engine.draft is not None
    grown = _calls(engine.draft, "propose_trees", monkeypatch)
    steps = _verified(engine, monkeypatch)
    assert _generate(engine, prompts, [k] * len(prompts)) == baseline
    decode_steps = len(steps) // len(prompts)
    assert 0 < len(grown) < decode_steps


def test_adaserve_needs_a_draft_model(runners: tuple[ModelRunner, ModelRunner]) -> None:
    with pytest.raises(ValueError, match="adaserve grows its trees with a draft model"):
        Engine(runners[0], proposer="ngram", adaserve=AdaServeTrees(COSTLY_VERIFY))


@pytest.mark.parametrize("cut", [False, True], ids=["whole-head", "cut-head"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_the_c_beam_grows_the_python_beams_trees(
    runners: tuple[ModelRunner, ModelRunner],
    cut_runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    cut: bool,
    calibrated: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every level in one C call gives the trees the Python levels give (tokens, parents,
    path probabilities, ranks), requests of different depths in one batch, each feeding the
    two known tokens its draft cache lacks (as after a verify)."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the beam runs in Python")
    draft_runner = (cut_runners if cut else runners)[1]
    in_c = _calls(draft_runner, "greedy_tree", monkeypatch)
    calibration = TreeCalibration()
    if calibrated:
        for i in range(60):
            calibration.observe(0, 0.15, True)
            calibration.observe(1, 0.25, i % 2 == 0)
    grown = []
    for fused in (True, False):
        draft = DraftModel(draft_runner)
        if not fused:
            monkeypatch.setattr(draft, "_propose_trees_fused", lambda *_: None)
        jobs = [
            TreeJob(f"t{i}", prompt, depth)
            for i, (prompt, depth) in enumerate(zip(prompts, (4, 2, 3, 1), strict=True))
        ]
        draft.prefill([(job.request_id, job.tokens[:-2]) for job in jobs])
        calls = len(in_c)
        grown.append(draft.propose_trees(jobs, 3, calibration))
        assert len(in_c) == calls + fused, "the C beam grew the trees" if fused else "Python"
        for job in jobs:
            draft.free(job.request_id)
    for c_tree, py_tree in zip(*grown, strict=True):
        assert (c_tree.tokens, c_tree.parents) == (py_tree.tokens, py_tree.parents)
        assert c_tree.ranks == py_tree.ranks
        assert c_tree.probs == pytest.approx(py_tree.probs, abs=1e-5)
    assert [len(t) for t in grown[0]] == [1 + 3 * 4, 1 + 3 * 2, 1 + 3 * 3, 1 + 3]


@pytest.mark.parametrize("fused", [True, False], ids=["c-beam", "python-levels"])
def test_every_tree_node_carries_the_drafts_probability_after_its_path(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    fused: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each node's probability given its parent is what the draft gives its token after the
    context and the node's path fed in order: the levels' masks hide cousins, and positions
    are context + depth (the draft's own ranking of that token is the node's rank)."""
    draft_runner = runners[1]
    in_c = _calls(draft_runner, "greedy_tree", monkeypatch)
    draft = DraftModel(draft_runner)
    if not fused:
        monkeypatch.setattr(draft, "_propose_trees_fused", lambda *_: None)
    prompt = prompts[0]
    draft.prefill([("t", prompt[:-2])])
    (tree,) = draft.propose_trees([TreeJob("t", prompt, 3)], 3, TreeCalibration())
    draft.free("t")
    assert len(in_c) == int(fused and cpu_kernels.load() is not None)
    assert len(tree) == 1 + 3 * 3
    reference = KVCacheManager(draft_runner.num_blocks)
    for node in range(1, len(tree)):
        path = tree.path_tokens(tree.parents[node])
        reference.append("ref", len(prompt) + len(path))
        table = reference.block_table("ref")
        logits = draft_runner.forward([ForwardSeq([*prompt, *path], table, 0, 1)])
        probs = logits[0].softmax(dim=-1)
        local = tree.probs[node] / tree.probs[tree.parents[node]]
        assert probs[tree.tokens[node]].item() == pytest.approx(local, abs=1e-4)
        assert int((probs > probs[tree.tokens[node]]).sum()) == tree.ranks[node]
        reference.free("ref")


def test_adaserve_trees_keep_shaped_greedy_output(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> None:
    """A greedy request with a logit bias and a repetition penalty: its tree rows are shaped
    after each node's own path, so its tokens are those it gets without speculation."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, logit_bias=((203, -100.0),), repetition_penalty=1.3, ignore_eos=True
    )
    outputs = [
        run(engine, Request("b", prompts[1], params, tier=Tier.BEST_EFFORT), ks)[0]
        for engine, ks in ((_engine(runners, None), [0]), (_adaserve_engine(runners), [4]))
    ]
    assert outputs[0] == outputs[1] and 203 not in outputs[0]
