"""Hypothesis strategies for OpenAI request bodies: every field we read, with any JSON value."""

from __future__ import annotations

from hypothesis import strategies as st

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "slo",
    "service_tier",
    "priority",
    "n",
    "logprobs",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "echo",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "min_p",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "unknown_field",
]
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["demo", "demo", "demo", "other", 3])},
    optional={name: json_values for name in FIELD_NAMES},
)
headers = st.dictionaries(
    st.sampled_from(["x-slo-ttft-ms", "x-slo-tpot-ms", "other"]), st.text(max_size=12), max_size=2
)
ascii_headers = st.dictionaries(
    st.sampled_from(["x-slo-ttft-ms", "x-slo-tpot-ms", "other"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
    max_size=2,
)
"""Header values a real HTTP client can send (printable ASCII, no edge whitespace)."""
