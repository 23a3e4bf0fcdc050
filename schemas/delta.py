"""Prompt delta encoding: a call's prompt as a reference to an earlier call plus the new suffix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .records import CallRecorded, PromptDelta


class DeltaError(ValueError):
    """A prompt delta that cannot be resolved against the calls at hand."""


def full_sequence(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[int]:
    return [*prompt_ids, *completion_ids]


def encode_prompt(prompt_ids: Sequence[int], base_call_index: int, base_sequence: Sequence[int]) -> PromptDelta | None:
    """Delta of ``prompt_ids`` against an earlier call's full sequence, or None if it shares no prefix.

    The shared prefix is taken as long as it runs, so a prompt that extends the earlier call's prompt
    plus its sampled ids (the usual case) stores only the appended tokens.
    """
    # Prompts run to tens of thousands of ids and this runs on every recorded call (the gateway's
    # request path), so comparisons happen on list slices, in C. Lists once up front: a tuple never
    # equals a list, and re-wrapping every slice cost as much as the comparisons (bench/_profile.py).
    prompt = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
    base = base_sequence if isinstance(base_sequence, list) else list(base_sequence)
    n = min(len(prompt), len(base))
    if prompt[:n] == (base if n == len(base) else base[:n]):  # the usual case: it extends the whole base
        i = n
    else:  # find the first mismatch: whole blocks first, then within the block
        i, block = 0, 1024
        while i + block <= n and prompt[i : i + block] == base[i : i + block]:
            i += block
        while i < n and prompt[i] == base[i]:
            i += 1
    if i == 0:
        return None
    return PromptDelta(base_call_index=base_call_index, base_len=i, suffix_ids=prompt[i:])


def resolve_prompt(call: CallRecorded, resolved: Mapping[int, Sequence[int]]) -> list[int]:
    """Full prompt ids of ``call``.

    ``resolved`` maps call_index -> full sequence (resolved prompt + completion ids) of the session's
    earlier calls. Raises DeltaError when the base is missing or shorter than the reference claims.
    """
    if call.prompt_ids is not None:
        return list(call.prompt_ids)
    d = call.prompt_delta
    assert d is not None  # guaranteed by CallRecorded's validator
    base = resolved.get(d.base_call_index)
    if base is None:
        raise DeltaError(f"call {call.call_index} of {call.session_id}: base call {d.base_call_index} is not available")
    if d.base_len > len(base):
        raise DeltaError(
            f"call {call.call_index} of {call.session_id}: base_len {d.base_len} exceeds base call "
            f"{d.base_call_index}'s {len(base)} tokens"
        )
    return [*base[: d.base_len], *d.suffix_ids]
