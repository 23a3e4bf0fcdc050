"""Inference engines behind the gateway: token ids in, token ids and logprobs out.

One small interface, ``Upstream.generate(prompt_ids, params)``, three wire formats:

- ``polar`` / ``vllm``: ``POST /v1/completions`` with ``prompt`` = token ids, ``return_token_ids``,
  ``logprobs: 0`` (only the sampled token's logprob); ids come back in ``choices[0].token_ids``.
- ``sglang``: ``POST /generate`` with ``input_ids`` and ``return_logprob``; point it at the workers, not
  the router, which strips token data.

Every engine failure becomes an ``UpstreamError`` here, at one boundary (aiohttp's errors never leak):

    UpstreamError
     ├── UpstreamTimeout          no answer in time             -> 504
     ├── UpstreamUnavailable      connect / transport failure   -> 502
     ├── UpstreamBadResponse      an answer we cannot trust     -> 502
     ├── UpstreamContextOverflow  prompt over the context       -> the provider's context-length error
     └── UpstreamRejected         any other 4xx/5xx, status passed through
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import orjson

from schemas import float32_digits

UpstreamKind = Literal["polar", "vllm", "sglang"]


class UpstreamError(Exception):
    status = 502

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class UpstreamTimeout(UpstreamError):
    status = 504


class UpstreamUnavailable(UpstreamError):
    status = 502


class UpstreamBadResponse(UpstreamError):
    status = 502


class UpstreamRejected(UpstreamError):
    """The engine answered 4xx/5xx; ``status`` is its status."""


class UpstreamContextOverflow(UpstreamError):
    status = 400

    def __init__(self, message: str, prompt_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass
class GenerateParams:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Generation:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    matched_stop: str = ""  # the stop string that ended it, if one did
    policy_version: int | None = None  # as the engine reports it, when it does
    upstream_ms: float = 0.0
    model: str = ""  # the model (or LoRA adapter) the engine says served it, when it does


@dataclass
class ModelInfo:
    id: str = ""
    max_model_len: int | None = None
    logprobs_mode: str = ""  # our engine reports it; vLLM does not ('')


class Upstream(Protocol):
    kind: str

    async def generate(self, prompt_ids: list[int], params: GenerateParams, *, request_id: str = "",
                       affinity: str = "", model: str = "") -> Generation:
        """Sample a completion for ``prompt_ids`` (``model``: a LoRA adapter's name, '' = the served
        model); raises UpstreamError."""

    async def model_info(self) -> ModelInfo:
        """The served model's id and context length, as far as the engine says."""

    async def aclose(self) -> None: ...


_VLLM_OVERFLOW = re.compile(r"maximum context length is (\d+) tokens.*?contains (?:at least )?(\d+) input tokens", re.S)
_SGLANG_OVERFLOW = re.compile(r"\((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")


def _overflow(message: str, prompt_len: int) -> UpstreamContextOverflow | None:
    """Recognise the engines' context-length errors (see shared/docs/vllm-api.md §4)."""
    if m := _VLLM_OVERFLOW.search(message):
        return UpstreamContextOverflow(message, int(m.group(2)), int(m.group(1)))
    if m := _SGLANG_OVERFLOW.search(message):
        return UpstreamContextOverflow(message, int(m.group(1)), int(m.group(2)))
    if "max_tokens must be at least 1, got 0" in message:  # prompt exactly fills the context
        return UpstreamContextOverflow(message, prompt_len, prompt_len)
    return None


def _int_version(value: Any) -> int | None:
    try:
        return int(value) if value is not None and str(value).strip() != "" else None
    except (TypeError, ValueError):
        return None


class HTTPUpstream:
    """Shared HTTP plumbing: one keep-alive pool, session-sticky worker choice, the error boundary.

    aiohttp, not httpx: on an 80 KB call the pool bookkeeping of httpx (every idle connection checked on
    each request, anyio socket wrappers) cost about as much as everything else the gateway adds.
    The session is made on first use, inside the serving event loop.
    """

    kind: str = ""
    path = ""

    def __init__(self, urls: list[str], *, served_model: str = "", timeout_s: float = 900.0, connect_timeout_s: float = 5.0,
                 max_connections: int = 512):
        if not urls:
            raise ValueError("engine url: at least one is required")
        self.urls = [u.rstrip("/") for u in urls]
        self.served_model = served_model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        # start-up questions (model, tokenizer probe): a silent engine must not hold the start for long
        self._aux_timeout = aiohttp.ClientTimeout(total=min(10.0, timeout_s), sock_connect=connect_timeout_s)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, auto_decompress=True,
                                                  skip_auto_headers=("User-Agent",))
        return self._session

    def _url(self, affinity: str) -> str:
        # One session sticks to one worker so its growing prefix stays in that worker's KV cache.
        return self.urls[zlib.crc32(affinity.encode()) % len(self.urls)] if affinity else self.urls[0]

    async def _post(self, base: str, body: dict[str, Any], prompt_len: int, request_id: str) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        headers = {"content-type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        try:  # orjson: prompts are tens of thousands of ids, stdlib json costs milliseconds each way
            async with self.session.post(base + self.path, data=orjson.dumps(body), headers=headers) as r:
                status, reason, content = r.status, r.reason or "", await r.read()
        except TimeoutError as e:  # aiohttp's connect and read timeouts are TimeoutErrors
            raise UpstreamTimeout(f"engine {base} did not answer in time ({type(e).__name__})") from e
        except aiohttp.ClientError as e:
            raise UpstreamUnavailable(f"engine {base} unreachable: {type(e).__name__}: {e}") from e
        ms = (time.perf_counter() - t0) * 1000
        if status >= 400:
            message = _error_message(content, reason)
            if status == 400 and (ov := _overflow(message, prompt_len)):
                raise ov
            raise UpstreamRejected(f"engine error {status}: {message}", status=status)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as e:
            raise UpstreamBadResponse(f"engine {base} sent a body that is not JSON") from e
        if not isinstance(data, dict):
            raise UpstreamBadResponse(f"engine {base} sent a JSON {type(data).__name__}, expected an object")
        return data, ms

    async def model_info(self) -> ModelInfo:
        try:
            async with self.session.get(self.urls[0] + "/v1/models", timeout=self._aux_timeout) as r:
                first = (orjson.loads(await r.read()).get("data") or [{}])[0] if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError, IndexError):
            return ModelInfo()
        return ModelInfo(id=str(first.get("id", "")), max_model_len=_int_version(first.get("max_model_len")),
                         logprobs_mode=str(first.get("logprobs_mode") or ""))

    async def tokenize(self, text: str) -> list[int] | None:
        """vLLM's ``POST /tokenize`` of ``text`` without special tokens; None if the engine has no such route."""
        body = {"model": self.served_model, "prompt": text, "add_special_tokens": False}
        data = await self._aux("/tokenize", body)
        if data is None or not isinstance(data.get("tokens"), list):
            return None  # not vLLM's /tokenize (an engine or proxy answering every path alike)
        return [int(t) for t in data["tokens"]]

    async def detokenize(self, ids: list[int]) -> str | None:
        """vLLM's ``POST /detokenize``; None if the engine has no such route or refuses the ids."""
        data = await self._aux("/detokenize", {"model": self.served_model, "tokens": ids})
        return None if data is None or not isinstance(data.get("prompt"), str) else data["prompt"]

    async def _aux(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            async with self.session.post(self.urls[0] + path, data=orjson.dumps(body),
                                         headers={"content-type": "application/json"},
                                         timeout=self._aux_timeout) as r:
                if r.status >= 400:
                    return None
                data = orjson.loads(await r.read())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(content: bytes, reason: str) -> str:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:500].decode("utf-8", "replace") or reason
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:2000]
    return str(err)[:2000]


class CompletionsUpstream(HTTPUpstream):
    """vLLM's (and our engine's) ``/v1/completions`` with token-id prompts."""

    kind = "vllm"
    path = "/v1/completions"

    async def generate(self, prompt_ids: list[int], params: GenerateParams, *, request_id: str = "",
                       affinity: str = "", model: str = "") -> Generation:
        """Sample with ``return_token_ids`` and the sampled token's logprob (``logprobs: 0``); a LoRA
        adapter is selected by sending its name as ``model`` (vLLM's runtime adapters)."""
        body: dict[str, Any] = {
            "model": model or self.served_model, "prompt": prompt_ids, "max_tokens": params.max_tokens,
            "logprobs": 0, "return_token_ids": True, "return_weight_versions": True,
            "skip_special_tokens": False,  # the gateway decodes ids itself; keep text comparable anyway
        }
        for k in ("temperature", "top_p", "top_k", "seed"):
            if (v := getattr(params, k)) is not None:
                body[k] = v
        if params.stop:
            body["stop"] = params.stop
        data, ms = await self._post(self._url(affinity), body, len(prompt_ids), request_id)
        return _parse_completions(data, prompt_ids, ms)


def _parse_completions(data: dict[str, Any], prompt_ids: list[int], ms: float) -> Generation:
    try:
        choice = data["choices"][0]
        ids = [int(i) for i in choice["token_ids"]]
        lp = choice.get("logprobs") or {}
        logprobs = [float32_digits(float(x)) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UpstreamBadResponse(f"engine response lacks choices[0].token_ids/logprobs ({type(e).__name__}: {e}); "
                                  "is it vLLM-compatible with return_token_ids?") from e
    if len(logprobs) != len(ids):
        raise UpstreamBadResponse(f"engine returned {len(logprobs)} logprobs for {len(ids)} tokens")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_ids:  # both lists: compared in C, no copy
        raise UpstreamBadResponse("engine reports different prompt token ids than it was sent")
    stop = choice.get("stop_reason")
    version = _int_version(data.get("policy_version"))
    if version is None and choice.get("weight_versions"):
        version = _int_version(choice["weight_versions"][-1].get("version"))
    return Generation(ids, logprobs, str(choice.get("finish_reason") or "stop"),
                      matched_stop=stop if isinstance(stop, str) else "", policy_version=version, upstream_ms=ms,
                      model=str(data.get("model") or ""))


class SGLangUpstream(HTTPUpstream):
    """SGLang's native ``/generate`` with ``input_ids`` (workers directly, not the router)."""

    kind = "sglang"
    path = "/generate"

    async def generate(self, prompt_ids: list[int], params: GenerateParams, *, request_id: str = "",
                       affinity: str = "", model: str = "") -> Generation:
        """Sample with ``return_logprob`` over output tokens only (``logprob_start_len: -1``); a LoRA
        adapter by name in SGLang's ``lora_path`` field (not run against a real SGLang)."""
        sp: dict[str, Any] = {"max_new_tokens": params.max_tokens, "skip_special_tokens": False, "no_stop_trim": True}
        for k in ("temperature", "top_p", "top_k", "seed"):
            if (v := getattr(params, k)) is not None:
                sp["sampling_seed" if k == "seed" else k] = -1 if k == "top_k" and v == 0 else v  # SGLang: -1 = off
        if params.stop:
            sp["stop"] = params.stop
        body = {"input_ids": prompt_ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1,
                "top_logprobs_num": 0, "return_prompt_token_ids": True}
        if request_id:
            body["rid"] = request_id
        if model:
            body["lora_path"] = model
        data, ms = await self._post(self._url(affinity), body, len(prompt_ids), request_id)
        return _parse_sglang(data, prompt_ids, ms)


def _parse_sglang(data: dict[str, Any], prompt_ids: list[int], ms: float) -> Generation:
    try:
        meta = data["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]
        logprobs = [float32_digits(float(t[0])) if t[0] is not None else 0.0 for t in triples]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UpstreamBadResponse(f"SGLang response lacks meta_info.output_token_logprobs ({type(e).__name__}); "
                                  "is return_logprob honoured (and is this a worker, not the router)?") from e
    if (out := data.get("output_ids")) is not None and list(out) != ids:
        raise UpstreamBadResponse("SGLang output_ids disagree with the ids of output_token_logprobs")
    echoed = data.get("prompt_token_ids")
    if echoed is not None and list(echoed) != prompt_ids:
        raise UpstreamBadResponse("engine reports different prompt token ids than it was sent")
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return Generation(ids, logprobs, "length" if kind == "length" else "abort" if kind == "abort" else "stop",
                      matched_stop=matched if isinstance(matched, str) else "",
                      policy_version=_int_version(meta.get("weight_version")), upstream_ms=ms)


def make_upstream(kind: str, urls: list[str], **kwargs: Any) -> Upstream:
    """The client for ``kind``: polar and vllm share the completions wire format."""
    if kind in ("polar", "vllm"):
        up = CompletionsUpstream(urls, **kwargs)
        up.kind = kind
        return up
    if kind == "sglang":
        return SGLangUpstream(urls, **kwargs)
    raise ValueError(f"upstream: unknown kind {kind!r}; expected polar, vllm or sglang")
