"""Prompt delta encoding: a growing session costs linear bytes and resolves back to the exact prompt."""

from __future__ import annotations

import pytest

from schemas import CallRecorded, DeltaError, PromptDelta, decode, encode, encode_prompt, full_sequence, resolve_prompt


def _call(index: int, prompt: list[int], completion: list[int], base: dict[int, list[int]]) -> CallRecorded:
    """A call whose prompt is delta-encoded against the previous call when they share a prefix."""
    delta = encode_prompt(prompt, index - 1, base[index - 1]) if index > 0 else None
    fields = {"prompt_delta": delta} if delta else {"prompt_ids": prompt}
    return CallRecorded(session_id="s", call_index=index, provider="engine", completion_ids=completion,
                        completion_logprobs=[-0.1] * len(completion), **fields)


def test_session_resolves_exactly_and_grows_linearly():
    prompts, completions, sequences, calls = [], [], {}, []
    prompt = list(range(100, 150))  # a 50-token system prompt + first user turn
    for i in range(12):
        completion = [1000 + i * 10 + k for k in range(8)]
        calls.append(_call(i, prompt, completion, sequences))
        prompts.append(prompt)
        completions.append(completion)
        sequences[i] = full_sequence(prompt, completion)
        prompt = [*sequences[i], *[2000 + i * 5 + k for k in range(5)]]  # tool result appended

    resolved: dict[int, list[int]] = {}
    for c in calls:  # decode from bytes, as a consumer would
        c = decode(encode(c), CallRecorded)
        p = resolve_prompt(c, resolved)
        resolved[c.call_index] = full_sequence(p, c.completion_ids)
    assert [resolved[i][: len(prompts[i])] for i in range(12)] == prompts

    suffix_sizes = [len(c.prompt_delta.suffix_ids) for c in calls[1:]]
    assert suffix_sizes == [5] * 11  # only the appended tool result is stored, never the history
    assert calls[0].prompt_ids == prompts[0]


def test_rewritten_history_shares_only_the_common_prefix():
    base = [1, 2, 3, 4, 5, 6]
    d = encode_prompt([1, 2, 9, 9], 0, base)
    assert d == PromptDelta(base_call_index=0, base_len=2, suffix_ids=[9, 9])
    assert encode_prompt([7, 8], 0, base) is None  # nothing shared: store the full prompt


def test_missing_or_short_base_is_a_clear_error():
    c = CallRecorded(session_id="s", call_index=3, provider="engine",
                     prompt_delta=PromptDelta(base_call_index=1, base_len=10, suffix_ids=[5]))
    with pytest.raises(DeltaError, match="base call 1 is not available"):
        resolve_prompt(c, {0: [1, 2]})
    with pytest.raises(DeltaError, match="base_len 10 exceeds base call 1's 4 tokens"):
        resolve_prompt(c, {1: [1, 2, 3, 4]})


def test_delta_must_point_backwards():
    with pytest.raises(ValueError, match="earlier call"):
        CallRecorded(session_id="s", call_index=2, provider="engine",
                     prompt_delta=PromptDelta(base_call_index=2, base_len=1, suffix_ids=[]))


@pytest.mark.parametrize("cut", [0, 1, 1023, 1024, 1025, 5000, 6143, 6144])
def test_long_prompts_find_the_first_mismatch_exactly(cut):
    """Block-wise comparison (bench/_profile.py: this runs on every call) agrees with a plain scan."""
    base = list(range(1, 6145))  # 6 blocks of 1024
    prompt = [*base[:cut], 0, *base[cut + 1:], 7, 8]  # 0: an id the base never has
    d = encode_prompt(tuple(prompt), 2, base)  # any Sequence: a tuple must match a list by value
    assert (d.base_len, d.suffix_ids) == (cut, prompt[cut:]) if cut else d is None
    extends = encode_prompt([*base, 7, 8], 2, tuple(base))
    assert (extends.base_len, extends.suffix_ids) == (6144, [7, 8])
    assert encode_prompt(base[:cut], 2, base) == (PromptDelta(base_call_index=2, base_len=cut, suffix_ids=[]) if cut else None)
