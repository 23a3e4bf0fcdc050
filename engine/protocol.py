"""Wire requests of vLLM's OpenAI-compatible server (the subset we serve), their validation and errors.

Field names, defaults and error messages follow vLLM 0.33 (see shared/docs/vllm-api.md). Unknown
fields are accepted and logged as ignored, as vLLM does. Parameters vLLM knows but this engine does not
implement (penalties, logit_bias, min_p, guided decoding, echo; prompt_logprobs on chat) are refused with a 400
when set to a non-default value: silently ignoring them would change the distribution we claim to
report logprobs for.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .sampling import SamplingParams

log = logging.getLogger("polarstream.engine")

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class EngineError(Exception):
    """An error answered in vLLM's shape: ``{"error": {message, type, param, code}}``, HTTP ``code``."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type or self.TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}


def bad_param(param: str, value: Any, message: str) -> EngineError:
    """A 400 naming the parameter, with vLLM's ``(parameter=P, value=V)`` suffix."""
    return EngineError(400, f"{message} (parameter={param}, value={value})", param)


def parse(cls: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into ``cls``; pydantic errors become a 400 naming the field."""
    if not isinstance(body, dict):
        raise EngineError(400, f"expected a JSON object, got {type(body).__name__}")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise bad_param(field, err.get("input"), err["msg"]) from None
    if req.model_extra:
        log.warning("The following fields were present in the request but ignored: %s", sorted(req.model_extra))
    return req


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_weight_versions: bool = False
    # known to vLLM, not implemented here: refused unless left at their defaults
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    SCORES_PROMPTS: ClassVar[bool] = False  # whether prompt_logprobs is served (/v1/completions only)

    def refuse_unsupported(self) -> None:
        unsupported = {
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
            "min_p": self.min_p not in (None, 0.0),
            "prompt_logprobs": self.prompt_logprobs is not None and not self.SCORES_PROMPTS,
            "response_format": self.response_format is not None and self.response_format.get("type") != "text",
            "structured_outputs": self.structured_outputs is not None,
        }
        for name, bad in unsupported.items():
            if bad:
                raise bad_param(name, getattr(self, name), f"{name} is not supported by this engine")

    def sampling(self, max_tokens: int, logprobs: int | None, skip_special_tokens: bool = True) -> SamplingParams:
        """Engine parameters, validated with vLLM's messages (``max_tokens`` already resolved)."""
        self.refuse_unsupported()
        if self.n < 1:
            raise bad_param("n", self.n, f"n must be at least 1, got {self.n}.")
        t = 1.0 if self.temperature is None else self.temperature
        if t < 0:
            raise bad_param("temperature", t, f"temperature must be non-negative, got {t}.")
        p = 1.0 if self.top_p is None else self.top_p
        if not 0.0 < p <= 1.0:
            raise bad_param("top_p", p, f"top_p must be in (0, 1], got {p}.")
        k = self.top_k or 0
        if k < -1:
            raise bad_param("top_k", k, f"top_k must be 0 (disable), or at least 1, got {k}.")
        if max_tokens < 1:
            raise bad_param("max_tokens", max_tokens, f"max_tokens must be at least 1, got {max_tokens}.")
        if self.min_tokens < 0:
            raise bad_param("min_tokens", self.min_tokens, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise bad_param("logprobs", logprobs, f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {MAX_LOGPROBS}")
        if logprobs is not None and logprobs < 0:
            raise bad_param("logprobs", logprobs, f"logprobs must be non-negative, got {logprobs}.")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        skip = skip_special_tokens if self.skip_special_tokens is None else self.skip_special_tokens
        return SamplingParams(
            max_tokens=max_tokens, temperature=t, top_p=p, top_k=max(k, 0), min_tokens=self.min_tokens,
            seed=self.seed, stop=tuple(s for s in stop if s), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=skip,
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a flat id list is one prompt, a list of lists several."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_param("prompt", p, "Prompt cannot be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    SCORES_PROMPTS: ClassVar[bool] = True

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        k = self.prompt_logprobs
        if k is not None and (k < -1 or k > MAX_LOGPROBS):
            raise bad_param("prompt_logprobs", k, f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                                                  f"{MAX_LOGPROBS}" if k > 0 else f"prompt_logprobs must be -1 or >= 0, got {k}.")
        if self.echo:
            raise bad_param("echo", True, "echo is not supported by this engine")
        if self.suffix is not None:
            raise bad_param("suffix", self.suffix, "suffix is not supported by this engine")
        if self.best_of not in (None, 1, self.n):
            raise bad_param("best_of", self.best_of, "best_of is not supported by this engine")


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    return_prompt_text: bool = False
    reasoning_effort: str | None = None

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad_param("top_logprobs", self.top_logprobs, "when using `top_logprobs`, `logprobs` must be set to true.")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's runtime adapter API)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="allow")
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM accepts it; adapters here are known by name only


def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an ``n > 1`` request gets seed + index (vLLM's child requests)."""
    return params if params.seed is None or index == 0 else replace(params, seed=params.seed + index)
