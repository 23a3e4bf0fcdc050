"""The HTTP API against a real engine: vLLM's field names, layouts and error messages."""

import logging

import pytest

COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics", "policy_version"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                          "prompt_token_ids", "routed_experts", "weight_versions"]
CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
             "policy_version"]
CHAT_CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts",
                    "weight_versions"]


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r


def error(client, path, body, status=400):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
    return err


def test_completion_layout_with_token_ids_and_logprobs(client):
    r = complete(client, prompt="def add(a, b):", max_tokens=6, logprobs=2, return_token_ids=True, seed=3,
                 return_weight_versions=True)
    body = r.json()
    assert list(body) == COMPLETION_KEYS and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert r.headers["x-policy-version"] == "0" and body["policy_version"] == 0
    (choice,) = body["choices"]
    assert list(choice) == COMPLETION_CHOICE_KEYS
    prompt_ids = client.post("/tokenize", json={"prompt": "def add(a, b):"}).json()["tokens"]
    assert choice["prompt_token_ids"] == prompt_ids
    ids = choice["token_ids"]
    assert len(ids) == 6 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + 6, "completion_tokens": 6,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert lp["tokens"] == [client.post("/detokenize", json={"tokens": [i]}).json()["prompt"] for i in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert val <= 0 and top[tok] == val and 2 <= len(top) <= 3
        assert list(top)[0] == tok  # the sampled token comes first
    assert choice["text"] == client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]


def test_without_return_token_ids_the_fields_are_null(client):
    (choice,) = complete(client, prompt="hello", max_tokens=2).json()["choices"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["logprobs"] is None


def test_id_prompt_equals_text_prompt_and_tokens_as_ids(client):
    ids = client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    a = complete(client, prompt="The quick brown fox", max_tokens=5, temperature=0, return_token_ids=True).json()
    b = complete(client, prompt=ids, max_tokens=5, temperature=0, return_token_ids=True, logprobs=0,
                 return_tokens_as_token_ids=True).json()
    assert a["choices"][0]["prompt_token_ids"] == b["choices"][0]["prompt_token_ids"] == ids
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert b["choices"][0]["logprobs"]["tokens"] == [f"token_id:{i}" for i in b["choices"][0]["token_ids"]]


def test_several_prompts_and_n_with_seeds(client):
    body = complete(client, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, seed=11, return_token_ids=True).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[5, 6, 7]] * 2 + [[8, 9]] * 2
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16
    # choice i of a seeded request uses seed + i (vLLM's child requests)
    again = complete(client, prompt=[5, 6, 7], max_tokens=4, seed=12, return_token_ids=True).json()
    assert again["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]
    assert body["choices"][0]["token_ids"] != body["choices"][1]["token_ids"]


def test_stop_token_ids_and_stop_strings(client):
    base = complete(client, prompt="Write a file", max_tokens=8, seed=5, return_token_ids=True, logprobs=0).json()["choices"][0]
    ids, toks = base["token_ids"], base["logprobs"]["tokens"]
    stop_id = ids[3]
    cut = ids.index(stop_id)
    hit = complete(client, prompt="Write a file", max_tokens=8, seed=5, return_token_ids=True, stop_token_ids=[stop_id]).json()["choices"][0]
    assert hit["finish_reason"] == "stop" and hit["stop_reason"] == stop_id
    assert hit["token_ids"] == ids[: cut + 1]  # the stop token is kept in the ids...
    assert hit["text"] == "".join(toks[:cut])  # ...but not in the text
    word = toks[2].strip() or toks[2]
    first = "".join(toks).find(word)
    hit = complete(client, prompt="Write a file", max_tokens=8, seed=5, return_token_ids=True, stop=[word]).json()["choices"][0]
    assert hit["finish_reason"] == "stop" and hit["stop_reason"] == word
    assert hit["text"] == "".join(toks)[:first]
    assert len(hit["token_ids"]) <= 3


def test_max_tokens_is_clamped_to_the_context(client):
    (choice,) = complete(client, prompt=list(range(10, 70)), max_tokens=16, return_token_ids=True).json()["choices"]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"


def test_chat_layout_logprobs_and_prompt_ids(client):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_completion_tokens": 5,
                                                  "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == CHAT_KEYS and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["prompt_token_ids"] == client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    (choice,) = body["choices"]
    assert list(choice) == CHAT_CHOICE_KEYS and len(choice["token_ids"]) == 5
    assert list(choice["message"]) == ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    for entry, tid in zip(content, choice["token_ids"]):
        tok = client.post("/detokenize", json={"tokens": [tid]}).json()["prompt"]
        assert entry["token"] == tok and entry["bytes"] == list(tok.encode())
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == tok
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    assert choice["message"]["content"] == "".join(e["token"] for e in content)


def test_chat_without_max_tokens_uses_the_rest_of_the_context(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "return_token_ids": True,
                                                  "ignore_eos": True})
    body = r.json()
    assert len(body["prompt_token_ids"]) + len(body["choices"][0]["token_ids"]) == 64


def test_unknown_fields_are_accepted_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="polarstream.engine"):
        complete(client, prompt="hi", max_tokens=1, frobnicate=True)
    assert "ignored: ['frobnicate']" in caplog.text


def test_models_health_tokenize_detokenize(client, served):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"] and data[0]["max_model_len"] == 64
    assert client.get("/health").status_code == 200
    tok = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 64
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    assert client.get("/policy_version").json() == {"model": "tiny", "policy_version": 0}


M = 64
CONTEXT = ("This model's maximum context length is 64 tokens. However, your prompt contains {} input tokens, which exceeds "
           "this limit even without any output tokens. Please reduce the length of the input prompt. "
           "(parameter=input_tokens, value={})")


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": list(range(1, 71))}, "input_tokens", CONTEXT.format(70, 70)),
    ({"prompt": list(range(1, 66))}, "input_tokens", CONTEXT.format("at least 65", 65)),
    ({"prompt": list(range(1, 65))}, "max_tokens", "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    ({"prompt": "hi", "max_tokens": 100}, "max_tokens",
     "max_tokens=100 cannot be greater than max_model_len=64. Please request fewer output tokens. (parameter=max_tokens, value=100)"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ({"prompt": "hi", "n": 0}, "n", "n must be at least 1, got 0. (parameter=n, value=0)"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"),
    ({"prompt": [1, 999999]}, "prompt", "Token id 999999 is out of vocabulary (parameter=prompt, value=999999)"),
    ({"prompt": []}, "prompt", None),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", None),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", None),
])
def test_completion_errors(client, body, param, message):
    err = error(client, "/v1/completions", body)
    assert err["type"] == "BadRequestError" and err["param"] == param
    if message:
        assert err["message"] == message


def test_text_prompt_over_the_context(client):
    err = error(client, "/v1/completions", {"prompt": "word " * 200})
    assert err["message"] == CONTEXT.format("at least 65", 65)


def test_other_errors(client):
    err = error(client, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, status=404)
    assert err == {"message": "The model `gpt-9` does not exist. Valid aliases: tiny.", "type": "NotFoundError",
                   "param": "model", "code": 404}
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert error(client, "/v1/chat/completions", {**chat, "tools": []})["param"] == "tools"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert error(client, "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"})["param"] == "tool_choice"
    assert error(client, "/v1/chat/completions", {**chat, "top_logprobs": 2})["param"] == "top_logprobs"
    assert "continue_final_message" in error(client, "/v1/chat/completions", {**chat, "continue_final_message": True})["message"]
    long_chat = {"messages": [{"role": "user", "content": "word " * 100}]}
    assert error(client, "/v1/chat/completions", long_chat)["param"] == "input_tokens"


def test_request_id_prompt_text_and_n_for_chat(client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", headers={"x-request-id": "abc123"},
                    json={"messages": msgs, "n": 2, "seed": 9, "max_tokens": 3, "return_prompt_text": True})
    body = r.json()
    assert body["id"] == "chatcmpl-abc123"
    assert body["prompt_text"] == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 6
    err = error(client, "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 65})
    assert err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens=65 cannot be greater")
    assert error(client, "/v1/completions", {"prompt": "hi", "n": 65})["param"] == "n"  # more than --max-num-seqs
