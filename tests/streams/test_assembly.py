"""The fold and both builders on hand-built sessions, checked token by token."""

import pytest

from schemas import CallRecorded, ChainInfo, PromptDelta
from streams.assembly import CallTokens, fold_calls, state_bytes
from streams.builders import assemble, finish, verify_trace


def call(i, prompt=None, completion=(), lps=None, delta=None, side=False, reason="", version=0):
    completion = list(completion)
    rec = CallRecorded(
        event_id=f"e{i}", session_id="s", call_index=i, provider="openai.chat",
        prompt_ids=None if prompt is None else list(prompt),
        prompt_delta=None if delta is None else PromptDelta(base_call_index=delta[0], base_len=delta[1], suffix_ids=delta[2]),
        completion_ids=completion, completion_logprobs=lps if lps is not None else [-0.5] * len(completion),
        side_call=side, chain=ChainInfo(break_reason=reason), policy_version=version,
    )
    return CallTokens.from_record(rec)


@pytest.fixture
def session():
    """Two turns, a side call, a third turn (full ids), then a compaction and a turn after it."""
    return [
        call(0, [1, 2, 3], [10, 11], [-0.1, -0.2], version=1),
        call(1, delta=(0, 5, [4, 5]), completion=[12], lps=[-0.3], version=1),  # [1,2,3,10,11,4,5]
        call(2, [7, 7], [13], [-0.4], side=True, reason="side_call"),
        call(3, [1, 2, 3, 10, 11, 4, 5, 12, 6], [14, 15], [-0.5, -0.6], version=2),
        call(4, [1, 2, 9], [16], [-0.7], reason="compaction"),
        call(5, delta=(4, 4, [8]), completion=[17], lps=[-0.8]),  # [1,2,9,16,8]
    ]


def test_prefix_merging_traces_masks_and_logprobs(session):
    out = assemble(session, "prefix_merging")
    main, side, compacted = out.traces
    assert main.call_indices == [0, 1, 3]
    assert main.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 14, 15]
    assert main.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert main.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, 0, -0.5, -0.6]
    assert main.policy_versions == [1, 1, 2] and main.break_reason == "first_call"
    assert (side.call_indices, side.token_ids, side.loss_mask, side.side_call) == ([2], [7, 7, 13], [0, 0, 1], True)
    assert compacted.call_indices == [4, 5] and compacted.break_reason == "compaction"
    assert compacted.token_ids == [1, 2, 9, 16, 8, 17] and compacted.loss_mask == [0, 0, 0, 1, 0, 1]
    assert out.merged == 3 and dict(out.breaks) == {"compaction": 1} and not out.dropped


def test_per_request_one_trace_per_call(session):
    out = assemble(session, "per_request")
    assert [t.call_indices for t in out.traces] == [[0], [1], [2], [3], [4], [5]]
    second = out.traces[1]
    assert second.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert second.loss_mask == [0] * 7 + [1] and second.logprobs == [0.0] * 7 + [-0.3]
    assert out.traces[3].loss_mask == [0] * 9 + [1, 1]  # earlier sampled ids are prompt here
    # Both builders train on the same sampled tokens; per_request repeats every prompt.
    merged = assemble(session, "prefix_merging")
    assert sum(map(sum, (t.loss_mask for t in out.traces))) == sum(map(sum, (t.loss_mask for t in merged.traces))) == 8
    assert sum(len(t.token_ids) for t in out.traces) > sum(len(t.token_ids) for t in merged.traces)


def test_side_calls_can_be_left_out(session):
    out = assemble(session, "prefix_merging", side_calls="drop")
    assert [t.call_indices for t in out.traces] == [[0, 1, 3], [4, 5]] and out.side_calls_left_out == 1


def test_out_of_order_and_duplicate_input_gives_the_same_traces(session):
    shuffled = [session[3], session[0], session[5], session[1], session[0], session[4], session[2]]
    assert assemble(shuffled, "prefix_merging").traces == assemble(session, "prefix_merging").traces


def test_detected_break_reasons():
    calls = [
        call(0, [1, 2], [3]),
        call(1, [1, 2], [4]),  # same prompt as call 0: a resample
        call(2, [1, 2, 4, 9], [5]),  # extends call 1's full sequence -> merges into its chain
        call(3, [1, 2, 4, 9, 6, 6], [7]),  # extends call 2's prompt but not its sampled id 5
        call(4, [8, 8], [9]),  # nothing in common
    ]
    out = assemble(calls, "prefix_merging")
    # Call 0's completion was discarded by the resample: no trace (see test_a_retry_...).
    assert [(t.call_indices, t.break_reason) for t in out.traces] == [
        ([1, 2], "resampled"), ([3], "retokenized"), ([4], "not_prefix")]
    assert dict(out.breaks) == {"resampled": 1, "retokenized": 1, "not_prefix": 1}
    assert out.dropped == {0: "replaced"}


@pytest.mark.parametrize("builder", ["per_request", "prefix_merging"])
@pytest.mark.parametrize("reason", ["retry", ""])  # the gateway's name for it, or detected here ("resampled")
def test_a_retry_never_trains_the_completion_it_replaced(builder, reason):
    p = [1, 2, 3, 10, 11, 4]  # turn 1's prompt: turn 0's full sequence + a tool result
    calls = [
        call(0, [1, 2, 3], [10, 11]),
        call(1, p, [12]),  # discarded by the harness ...
        call(2, p, [13], reason=reason),  # ... which retried: discarded too
        call(3, p, [15], reason=reason),  # ... and retried again; this one the session continues from
        call(4, [*p, 15, 5], [14]),
    ]
    out = assemble(calls, builder)
    trained = {tok for t in out.traces for tok, m in zip(t.token_ids, t.loss_mask) if m}
    assert trained == {10, 11, 15, 14}  # never 12 or 13, under any trace
    assert sorted(i for t in out.traces for i in t.call_indices) == [0, 3, 4]
    assert out.dropped == {1: "replaced", 2: "replaced"}
    assert all(12 not in t.token_ids and 13 not in t.token_ids for t in out.traces)  # not even as context
    if builder == "prefix_merging":
        assert [t.call_indices for t in out.traces] == [[0], [3, 4]]


def test_longest_tip_wins():
    calls = [
        call(0, [1, 2, 3], [4]),  # chain A: [1,2,3,4]
        call(1, [1, 2], [3]),  # chain B: [1,2,3], not an extension of A
        call(2, [1, 2, 3, 4, 5], [6]),  # both tips are prefixes; A is longer
    ]
    out = assemble(calls, "prefix_merging")
    assert [t.call_indices for t in out.traces] == [[0, 2], [1]]


def test_unresolvable_delta_is_a_counted_drop_not_a_guess():
    calls = [call(0, [1, 2], [3]), call(2, delta=(1, 3, [4]), completion=[5]), call(3, delta=(0, 9, [4]), completion=[6])]
    out = assemble(calls, "prefix_merging")
    assert [t.call_indices for t in out.traces] == [[0]]
    assert out.dropped == {2: "delta_unresolved", 3: "delta_unresolved"} and out.breaks["delta_unresolved"] == 2


def test_fold_state_is_linear_in_session_tokens():
    calls = [call(0, list(range(100)), [1000])]
    prompt = list(range(100)) + [1000]
    for i in range(1, 50):
        calls.append(call(i, delta=(i - 1, len(prompt), [7] * 10), completion=[1000 + i]))
        prompt = prompt + [7] * 10 + [1000 + i]
    fold = fold_calls(calls)
    assert len(fold.chains) == 1 and len(fold.chains[0].tokens) == len(prompt)
    # One copy of the final sequence (+ logprobs), not the ~15k tokens of all prompts together.
    assert state_bytes(fold) < 8 * 2 * len(prompt) + 64 * 50


def test_fold_refuses_descending_calls():
    fold = fold_calls([call(0, [1], [2])])
    from streams.assembly import extend
    with pytest.raises(ValueError, match="must ascend"):
        extend(fold, call(0, [1], [2]))


@pytest.mark.parametrize("corrupt, problem", [
    (lambda t: t.logprobs.__setitem__(3, -9.0), "logprobs are not at"),
    (lambda t: t.token_ids.__setitem__(4, 99), "sampled ids are not at"),
    (lambda t: t.loss_mask.__setitem__(0, 1), "trainable tokens for"),
    (lambda t: t.loss_mask.__setitem__(3, 0), "not all trainable"),
    (lambda t: t.logprobs.__setitem__(5, -0.1), "carries a logprob"),  # an interstitial token
    (lambda t: t.logprobs.__setitem__(0, float("nan")), "carries a logprob"),
    (lambda t: t.logprobs.append(0.0), "lengths"),
])
def test_verify_trace_catches_misplaced_tokens(session, corrupt, problem):
    trace = assemble(session, "prefix_merging").traces[0]
    by_index = {c.call_index: c for c in session}
    assert verify_trace(trace, by_index) == ""
    corrupt(trace)
    assert problem in verify_trace(trace, by_index)


def test_a_corrupted_chain_is_a_counted_break_with_per_call_fallback(session):
    by_index = {c.call_index: c for c in session}
    fold = fold_calls(session)
    fold.chains[0].members[2].logprobs[0] = -9.0  # and call 3's logprob
    out = finish(fold, by_index, "prefix_merging")
    assert out.breaks["verify_failed"] == 1
    fallback = [t for t in out.traces if t.break_reason == "verify_failed"]
    assert [t.call_indices for t in fallback] == [[0], [1]]  # calls 0 and 1 still verify alone
    assert out.dropped == {3: "verify_failed"}


def test_a_call_sampled_off_the_runs_settings_is_context_never_trained(session):
    import dataclasses

    from schemas import EngineSampling

    off = dataclasses.replace(session[1], off_run_sampling=True)  # e.g. a harness's own top_p in --sampling pass
    calls = [session[0], off, *session[2:]]
    merged = assemble(calls, "prefix_merging")
    main = merged.traces[0]
    assert main.call_indices == [0, 3] and main.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 14, 15]
    assert main.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]  # call 1's sampled id 12 stays, as context
    assert merged.dropped == {1: "sampling_mismatch"} and merged.merged == 3
    assert [t.call_indices for t in assemble(calls, "per_request").traces] == [[0], [2], [3], [4], [5]]
    # from a record, and through the state tables' JSON
    rec = CallRecorded(event_id="x", session_id="s", call_index=0, provider="openai.chat", prompt_ids=[1],
                       sampling=EngineSampling(temperature=0.7, top_p=0.95, top_k=64, matches_run=False))
    tokens = CallTokens.from_record(rec)
    assert tokens.off_run_sampling and CallTokens.from_json(tokens.to_json()) == tokens
    assert not CallTokens.from_record(rec.model_copy(update={"sampling": None})).off_run_sampling  # older records


@pytest.mark.parametrize("delta", [False, True])
def test_held_bytes_is_about_what_a_decoded_call_takes_in_memory(delta):
    """The session stage caches calls as decoded and bounds the cache by ``held_bytes``: it must not
    understate the memory (measured with tracemalloc) of a call with real-vocabulary ids."""
    import random
    import tracemalloc

    from schemas import decode, encode

    rnd = random.Random(1)
    ids = [rnd.randrange(1000, 151_000) for _ in range(4000)]
    completion = [rnd.randrange(1000, 151_000) for _ in range(300)]
    rec = CallRecorded(event_id="e", session_id="s", call_index=1, provider="openai.chat",
                       prompt_ids=None if delta else ids,
                       prompt_delta=PromptDelta(base_call_index=0, base_len=9000, suffix_ids=ids) if delta else None,
                       completion_ids=completion, completion_logprobs=[-rnd.random() for _ in completion])
    data = encode(rec)
    measured = []
    for _ in range(3):  # the least of three: another thread allocating meanwhile only adds to a measure
        tracemalloc.start()
        try:
            tokens = CallTokens.from_record(decode(data, CallRecorded))  # the record itself is dropped
            measured.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
    used = min(measured)
    assert used * 0.95 <= tokens.held_bytes() <= used * 1.3, (used, tokens.held_bytes())


def test_a_delta_encoded_session_folds_as_its_full_prompts_do():
    """The merge of a call that extends a tip by its delta never builds the prompt; random sessions with
    branches, resamples and side calls must fold exactly as the same calls with full prompt ids. Ids
    from a tiny vocabulary make a resampled branch's tokens collide with another chain's tip."""
    for seed in range(300):
        _fold_both_ways(seed)


def _fold_both_ways(seed):
    import random

    rng = random.Random(seed)
    full, delta, sequences = [], [], []  # sequences[i]: call i's prompt + completion
    for i in range(rng.randint(2, 14)):
        completion = [rng.randint(0, 2) for _ in range(rng.randint(0, 3))]
        side = i > 0 and rng.random() < 0.15
        kind = rng.random()
        if i == 0 or side or kind < 0.1:  # a fresh prompt
            prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 4))]
            base = None
        else:
            base = rng.randrange(i)
            cut = len(sequences[base]) if kind < 0.8 else rng.randint(0, len(sequences[base]))
            prompt = sequences[base][:cut] + [rng.randint(0, 2) for _ in range(rng.randint(0, 3))]
        full.append(call(i, prompt, completion, side=side))
        delta.append(full[-1] if base is None else call(i, delta=(base, cut, prompt[cut:]), completion=completion, side=side))
        sequences.append(prompt + completion)
    for builder in ("prefix_merging", "per_request"):
        assert assemble(delta, builder).traces == assemble(full, builder).traces, seed
    a, b = fold_calls(delta), fold_calls(full)
    assert (a.where, a.dropped, a.merged, a.breaks) == (b.where, b.dropped, b.merged, b.breaks), seed
