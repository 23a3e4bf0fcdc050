"""Engine wire formats -> Generation, and engine error texts -> typed errors (pure parsing)."""

import struct

import pytest

from gateway.upstream import (
    UpstreamBadResponse,
    UpstreamContextOverflow,
    _overflow,
    _parse_completions,
    _parse_sglang,
)

# Key order and values as in shared/docs/vllm-api.md §2 (vLLM 0.33, logprobs: 0, return_token_ids: true).
VLLM = {
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "text": "Done.",
                 "logprobs": {"text_offset": [0, 4, 5], "token_logprobs": [-0.05, -0.25, -0.5], "tokens": ["Done", ".", "<|im_end|>"],
                              "top_logprobs": [{"Done": -0.05}, {".": -0.25}, {"<|im_end|>": -0.5}]},
                 "finish_reason": "stop", "stop_reason": None, "token_ids": [812, 13, 2], "prompt_logprobs": None,
                 "prompt_token_ids": [1, 882, 198], "routed_experts": None,
                 "weight_versions": [{"version": "7", "start": 0, "end": 3}]}],
    "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
}


def test_vllm_completion_ids_logprobs_and_weight_version():
    g = _parse_completions(VLLM, [1, 882, 198], 3.0)
    assert (g.completion_ids, g.logprobs, g.finish_reason) == ([812, 13, 2], [-0.05, -0.25, -0.5], "stop")
    assert g.policy_version == 7 and g.upstream_ms == 3.0


def test_logprobs_are_kept_at_the_float32_precision_engines_compute_them_in():
    # vLLM prints a float32 logprob widened to float64: 17 digits. 9 give back the same float32.
    wide = [-0.40309274196624756, -2.384185791015625e-07, -0.05]
    choice = {**VLLM["choices"][0], "logprobs": {"token_logprobs": wide}}
    g = _parse_completions({**VLLM, "choices": [choice]}, [1, 882, 198], 0)
    assert g.logprobs == [-0.403092742, -2.38418579e-07, -0.05]
    assert struct.pack("<3f", *g.logprobs) == struct.pack("<3f", *wide)
    sg = _parse_sglang({"meta_info": {"output_token_logprobs": [[lp, i, None] for lp, i in zip(wide, [812, 13, 2])],
                                      "finish_reason": {"type": "stop"}}}, [1], 0)
    assert sg.logprobs == g.logprobs


def test_top_level_policy_version_wins():
    assert _parse_completions({**VLLM, "policy_version": 3}, [1, 882, 198], 0).policy_version == 3


def test_vllm_stop_string_is_reported():
    body = {**VLLM, "choices": [{**VLLM["choices"][0], "stop_reason": "</answer>"}]}
    assert _parse_completions(body, [1, 882, 198], 0).matched_stop == "</answer>"


def test_prompt_echo_mismatch_is_refused():
    with pytest.raises(UpstreamBadResponse, match="different prompt"):
        _parse_completions(VLLM, [1, 882, 199], 0)


def test_missing_token_ids_is_refused_with_a_hint():
    body = {"choices": [{"text": "x", "logprobs": None, "finish_reason": "stop"}]}
    with pytest.raises(UpstreamBadResponse, match="return_token_ids"):
        _parse_completions(body, [1], 0)


def test_logprob_count_mismatch_is_refused():
    body = {"choices": [{**VLLM["choices"][0], "token_ids": [812, 13]}]}
    with pytest.raises(UpstreamBadResponse, match="3 logprobs for 2 tokens"):
        _parse_completions(body, [1, 882, 198], 0)


SGLANG = {
    "text": "Done.", "output_ids": [812, 13, 2], "prompt_token_ids": [1, 882, 198],
    "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 3,
                  "weight_version": "4", "output_token_logprobs": [[-0.05, 812, None], [-0.25, 13, None], [-0.5, 2, None]]},
}


def test_sglang_generate_response():
    g = _parse_sglang(SGLANG, [1, 882, 198], 1.0)
    assert (g.completion_ids, g.logprobs, g.finish_reason, g.policy_version) == ([812, 13, 2], [-0.05, -0.25, -0.5], "stop", 4)
    length = {**SGLANG, "meta_info": {**SGLANG["meta_info"], "finish_reason": {"type": "length", "length": 3}}}
    assert _parse_sglang(length, [1, 882, 198], 0).finish_reason == "length"


def test_sglang_router_shaped_answer_is_refused():
    with pytest.raises(UpstreamBadResponse, match="router"):
        _parse_sglang({"text": "Done.", "meta_info": {"finish_reason": {"type": "stop"}}}, [1], 0)


@pytest.mark.parametrize(
    "message,prompt,limit",
    [
        ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, which exceeds "
         "this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=5000)", 5000, 4096),
        ("This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, "
         "which exceeds this limit", 4097, 4096),
        ("The input (9000 tokens) is longer than the model's context length (8192 tokens).", 9000, 8192),
        ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", 77, 77),
    ],
)
def test_context_overflow_texts(message, prompt, limit):
    e = _overflow(message, 77)
    assert isinstance(e, UpstreamContextOverflow) and (e.prompt_tokens, e.limit) == (prompt, limit)


def test_other_400s_are_not_overflow():
    assert _overflow("Token id 99999 is out of vocabulary", 10) is None
