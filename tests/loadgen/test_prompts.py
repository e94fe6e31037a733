"""Prompts for real runs: held-out demo-corpus text that encodes to exactly the asked length."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.prompts import (
    DOCUMENT_SEPARATOR,
    ChatPromptSource,
    Prompt,
    PromptSource,
    demo_training_script,
    heldout_texts,
)
from router.tokenizer import TextCodec


@pytest.fixture(scope="module")
def tokenizer_dir(target_dir: Path) -> Path:
    if not (target_dir / "tokenizer.json").is_file():
        pytest.skip(f"demo model not trained yet: no tokenizer.json in {target_dir}")
    return target_dir


@pytest.fixture(scope="module")
def source(tokenizer_dir: Path) -> PromptSource:
    return PromptSource.for_demo(tokenizer_dir, seed=0)


@pytest.mark.parametrize("n", [1, 2, 17, 256, 1500])
def test_prompt_encodes_to_exactly_the_requested_length(source: PromptSource, n: int) -> None:
    for _ in range(5):
        prompt = source.prompt(n)
        assert len(prompt.token_ids) == n
        encoded = source.tokenizer.encode(prompt.text, add_special_tokens=False).ids
        assert list(prompt.token_ids) == encoded


def test_prompts_come_from_the_heldout_split(source: PromptSource) -> None:
    heldout = DOCUMENT_SEPARATOR.join(heldout_texts())
    train, _ = demo_training_script().read_split()
    for _ in range(5):
        text = source.prompt(200).text
        assert text in heldout
        assert not any(text in doc for doc in train)


def test_prompts_are_deterministic_for_a_seed(tokenizer_dir: Path) -> None:
    a = PromptSource.for_demo(tokenizer_dir, seed=3)
    b = PromptSource.for_demo(tokenizer_dir, seed=3)
    c = PromptSource.for_demo(tokenizer_dir, seed=4)
    first = [a.prompt(64) for _ in range(3)]
    assert first == [b.prompt(64) for _ in range(3)]
    assert first != [c.prompt(64) for _ in range(3)]


def test_bad_lengths_and_folders_raise(source: PromptSource, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="integer >= 1"):
        source.prompt(0)
    with pytest.raises(ValueError, match="exceeds the prompt corpus"):
        source.prompt(len(source.stream) + 1)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        PromptSource.for_demo(tmp_path, seed=0)
    with pytest.raises(ValueError, match="empty"):
        PromptSource(source.tokenizer, [], seed=0)


def test_a_prompt_after_a_prefix_starts_with_its_text_and_tokens(source: PromptSource) -> None:
    prefix = source.prompt(48)
    for n in (49, 60, 300):
        prompt = source.prompt_after(prefix, n)
        assert prompt.text.startswith(prefix.text)
        assert prompt.token_ids[:48] == prefix.token_ids and len(prompt.token_ids) == n
        encoded = source.tokenizer.encode(prompt.text, add_special_tokens=False).ids
        assert list(prompt.token_ids) == encoded
    with pytest.raises(ValueError, match="no room after a 48-token prefix"):
        source.prompt_after(prefix, 48)


def test_requests_of_a_class_with_a_system_prompt_share_its_text(source: PromptSource) -> None:
    from loadgen.mixes import mix_from_dict
    from loadgen.run_load import prompts_for
    from loadgen.workloads import WorkloadConfig, generate_workload

    classes = [
        {"name": "support", "share": 1, "prompt": 80, "output": 4, "system_prompt": 40},
        {"name": "plain", "share": 1, "prompt": 80, "output": 4},
    ]
    for c in classes:
        c |= {"ttft": "loose", "tpot": "loose"}
    mix = mix_from_dict({"classes": classes}, "x")
    workload = generate_workload(mix, [0.0] * 20, WorkloadConfig(lambda n: 0.01), seed=1)
    prompts = prompts_for(workload, source)
    support = [prompts[r.request_id] for r in workload if r.scenario == "support"]
    plain = [prompts[r.request_id] for r in workload if r.scenario == "plain"]
    assert len(support) > 1 and len(plain) > 1
    assert len({p.token_ids[:40] for p in support}) == 1
    assert len({p.token_ids[40:] for p in support}) == len(support)
    assert len({p.token_ids[:40] for p in plain}) == len(plain)
    assert all(len(p.token_ids) == 80 for p in support + plain)


def test_follow_up_rounds_start_from_the_prompt_and_output_of_the_round_before(
    source: PromptSource,
) -> None:
    """Cut before the run: the sessions' first rounds only, sharing the system prompt. A
    follow-up, made when the round before ends, starts with that round's prompt and output."""
    from loadgen.mixes import mix_from_dict
    from loadgen.run_load import next_round, prompts_for
    from loadgen.workloads import WorkloadConfig, generate_workload

    agent = {"name": "agent", "share": 1, "prompt": 40, "output": 6, "system_prompt": 20}
    agent |= {"ttft": "tight", "tpot": "loose", "tools": {"calls": 2, "response": 10}}
    mix = mix_from_dict({"classes": [agent]}, "x")
    workload = generate_workload(mix, [0.0] * 4, WorkloadConfig(lambda n: 0.01), seed=1)
    prompts = prompts_for(workload, source)
    firsts = [r for r in workload if r.follows is None]
    assert sorted(prompts) == sorted(r.request_id for r in firsts)
    assert len({prompts[r.request_id].token_ids[:20] for r in firsts}) == 1
    assert len({prompts[r.request_id].token_ids[20:] for r in firsts}) == 4
    by_id = {r.request_id: r for r in workload}
    follow_up = next_round(source)
    follow_ups = [r for r in workload if r.follows is not None]
    assert len(follow_ups) == 8
    for r in follow_ups:
        before = by_id[r.follows]
        output = source.prompt(before.output_len).text
        prompt = follow_up(r, before, prompts[before.request_id], output)
        prompts[r.request_id] = prompt
        assert prompt.text.startswith(prompts[before.request_id].text + output)
        assert len(prompt.token_ids) == r.prompt_len
        assert (
            list(prompt.token_ids)
            == source.tokenizer.encode(prompt.text, add_special_tokens=False).ids
        )


def test_a_next_prompt_is_the_history_as_sent_back_then_a_seeded_response(
    source: PromptSource, tokenizer_dir: Path
) -> None:
    before = source.prompt(30)
    output = source.prompt(8).text
    history = source.tokenizer.encode(before.text + output, add_special_tokens=False).ids
    prompt = source.after_output(before, output, 60, 80, key="s.r1")
    assert prompt.text.startswith(before.text + output)
    assert prompt.token_ids[: len(history)] == tuple(history) and len(prompt.token_ids) == 80
    again = PromptSource.for_demo(tokenizer_dir, seed=0)
    again.prompt(5)
    assert again.after_output(before, output, 60, 80, key="s.r1") == prompt
    assert source.after_output(before, output, 60, 80, key="s.r2") != prompt


def test_an_output_longer_than_planned_is_cut_at_the_history_length(
    source: PromptSource,
) -> None:
    before = source.prompt(30)
    output = source.prompt(40).text
    prompt = source.after_output(before, output, 40, 50, key="long")
    assert len(prompt.token_ids) == 50
    assert prompt.text.startswith(before.text) and not prompt.text.startswith(before.text + output)
    assert prompt.token_ids[:40] == tuple(
        source.tokenizer.encode(before.text + output, add_special_tokens=False).ids[:40]
    )
    with pytest.raises(ValueError, match=r"history_len=50 must lie in \[30, num_tokens=50\)"):
        source.after_output(before, output, 50, 50, key="long")
    with pytest.raises(ValueError, match="history_len=29"):
        source.after_output(before, output, 29, 50, key="long")


@pytest.fixture(scope="module")
def chats(source: PromptSource, tokenizer_dir: Path) -> ChatPromptSource:
    return ChatPromptSource(source, TextCodec.from_dir(tokenizer_dir).render_chat)


def rendered_as_the_server_does(chats: ChatPromptSource, prompt: Prompt) -> list[int]:
    text = chats.render([{"role": r, "content": c} for r, c in prompt.messages])
    assert text == prompt.text
    return list(chats.source.tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("n", [8, 30, 300])
def test_a_chat_prompt_renders_to_exactly_the_requested_length(
    chats: ChatPromptSource, n: int
) -> None:
    for _ in range(3):
        prompt = chats.prompt(n)
        assert [role for role, _ in prompt.messages] == ["user"]
        assert rendered_as_the_server_does(chats, prompt) == list(prompt.token_ids)
        assert len(prompt.token_ids) == n
    with pytest.raises(ValueError, match="no room for a user message"):
        chats.prompt(3)


def test_a_shared_prefix_becomes_the_system_message(chats: ChatPromptSource) -> None:
    system = chats.prompt(40)
    a, b = chats.prompt_after(system, 90), chats.prompt_after(system, 120)
    for prompt, n in ((a, 90), (b, 120)):
        assert prompt.messages[0] == ("system", system.messages[0][1])
        assert prompt.messages[1][0] == "user" and len(prompt.token_ids) == n
        assert rendered_as_the_server_does(chats, prompt) == list(prompt.token_ids)
    shared = next(
        i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids[:90], strict=True)) if x != y
    )
    assert shared >= 38
    with pytest.raises(ValueError, match="one message"):
        chats.prompt_after(a, 200)


def test_a_chat_session_goes_on_with_the_output_as_the_assistants_message(
    chats: ChatPromptSource,
) -> None:
    before = chats.prompt_after(chats.prompt(30), 80)
    output = chats.source.prompt(10).text
    after = chats.after_output(before, output, 90, 130, key="s.r1")
    assert after.messages[:2] == before.messages
    assert after.messages[2] == ("assistant", output) and after.messages[3][0] == "user"
    assert len(after.token_ids) == 130 and after.token_ids[:70] == before.token_ids[:70]
    assert rendered_as_the_server_does(chats, after) == list(after.token_ids)
    assert chats.after_output(before, output, 90, 130, key="s.r1") == after
    cut = chats.after_output(before, output, 84, 130, key="s.r1")
    assert cut.messages[2][0] == "assistant" and output.startswith(cut.messages[2][1])
    assert cut.messages[2][1] != output
    tight = chats.after_output(before, output, 90, 92, key="s.r1")
    assert len(tight.token_ids) == 92 and len(tight.messages[2][1]) < len(output)
    with pytest.raises(ValueError, match="history_len=79"):
        chats.after_output(before, output, 79, 130, key="s.r1")
    least = 80 + chats.round_growth()
    smallest = chats.after_output(before, output, least - 1, least, key="s.r1")
    assert len(smallest.token_ids) == least and smallest.messages[2][0] == "assistant"
    assert chats.source.round_growth() == 1
