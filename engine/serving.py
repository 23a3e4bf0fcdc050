"""Request handling: wire request -> validated prompts and jobs -> batcher -> vLLM-shaped body.

``Engine`` is everything one server holds (model, tokenizer, batcher, optional script, names, LoRA
adapters). Routes in ``engine/app.py`` call its methods and never touch the model themselves.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infra.settings import Settings

from .batcher import Batcher, Job, Refused, Sequence
from .lora import VLLM_MAX_LORA_RANK, Adapter, AdapterError, Adapters, read_adapter
from .models import LoadedModel
from .protocol import (ChatRequest, CompletionRequest, EngineError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                       bad_param, with_seed)
from .responses import TokenText, chat_body, chat_choice, completion_body
from .sampling import SamplingParams
from .script import Script

log = logging.getLogger("polarstream.engine")


@dataclass
class EngineOptions:
    """Server options (the CLI flags of ``polarstream engine``)."""

    served_model_names: list[str] = field(default_factory=list)  # [] -> the --model argument
    max_model_len: int | None = None  # None -> the model config's max_position_embeddings
    max_num_seqs: int = 64
    logprobs_mode: str = "processed_logprobs"
    seed: int = 0
    policy_version: int = 0
    threads: int = 0  # CPU threads of the engine thread; 0: 1 for tiny models, else torch's default
    prefix_cache_mb: int = 256  # KV kept for prefix reuse across requests; 0 disables it
    script_window: int = 0  # scripted mode: score forced turns over the prompt's last N tokens only (0: full prefill)
    # LoRA, as vLLM's flags (docs/engine.md "LoRA adapters"): adapters are served with or without
    # enable_lora (nothing is preallocated here); enable_lora applies vLLM's default rank limit.
    enable_lora: bool = False
    max_loras: int = 1  # vLLM: distinct adapters in one batch; accepted, not enforced (any mix is batched here)
    max_lora_rank: int | None = None  # adapters of a higher rank are refused; None: 16 with enable_lora, else none
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # (name, path) loaded at start
    logit_noise: float = 0.0  # sigma of the seeded Gaussian noise added to the logits (sampling.perturb); 0: off


class Engine:
    def __init__(self, lm: LoadedModel, model_arg: str, options: EngineOptions | None = None, script: Script | None = None):
        self.options = options = options or EngineOptions()
        self.lm, self.tokenizer, self.script = lm, lm.tokenizer, script
        self.names = options.served_model_names or [model_arg]
        self.max_model_len = options.max_model_len or lm.max_model_len
        self.vocab_size = len(self.tokenizer)
        # vLLM rejects text that could not fit even if every token were the longest vocab entry
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.adapters = Adapters(lm.model)
        self.max_lora_rank = options.max_lora_rank or (VLLM_MAX_LORA_RANK if options.enable_lora else None)
        self._adapter_lock = asyncio.Lock()  # one load/unload at a time: the name checks hold until the change
        self.batcher = Batcher(lm.model, lm.tokenizer, lm.eos_token_ids, max_num_seqs=options.max_num_seqs,
                               logprobs_mode=options.logprobs_mode, seed=options.seed, policy_version=options.policy_version,
                               threads=options.threads, prefix_cache_bytes=options.prefix_cache_mb << 20,
                               script_window=options.script_window if script is not None else 0, adapters=self.adapters)
        self.batcher.logit_noise = options.logit_noise
        self.created = int(time.time())

    @property
    def policy_version(self) -> int:
        return self.batcher.policy_version

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    # ------------------------------------------------------------------ validation helpers

    def check_model(self, name: str | None) -> str:
        """The requested model name: a served base alias or a loaded adapter (vLLM's 404 otherwise)."""
        self.resolve(name)
        return name or self.names[0]

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        if name is None or name in self.names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise EngineError(404, f"The model `{name}` does not exist. Valid aliases: "
                                   f"{', '.join([*self.names, *self.adapters.loaded])}.", "model")
        return adapter

    # ------------------------------------------------------------------ LoRA adapters (vLLM's runtime API)

    async def load_adapter(self, req: LoadLoRAAdapterRequest, settings: Settings) -> str:
        """Read the adapter at ``lora_path`` (while serving), then register it between two steps."""
        async with self._adapter_lock:
            return await self._load_adapter(req, settings)

    async def _load_adapter(self, req: LoadLoRAAdapterRequest, settings: Settings) -> str:
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise EngineError(400, "Both 'lora_name' and 'lora_path' must be provided.", None, "InvalidUserInput")
        if name in self.adapters.loaded and not req.load_inplace:
            raise EngineError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                                   "in place, set 'load_inplace' to True.", None, "InvalidUserInput")
        if name in self.names:
            raise EngineError(400, f"The lora adapter name '{name}' conflicts with a served base model.", "lora_name",
                              "InvalidUserInput")
        try:
            adapter = await asyncio.to_thread(read_adapter, name, path, self.lm.model, settings)
        except AdapterError as e:
            not_found = str(e).startswith("No adapter found")
            raise EngineError(404 if not_found else 400, str(e), None, "NotFoundError" if not_found else "BadRequestError") from None
        except (OSError, ValueError) as e:
            raise EngineError(400, f"cannot load adapter {name!r} from {path}: {e}", None, "BadRequestError") from None
        await self._install(adapter)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def install_adapter(self, adapter: Adapter) -> None:
        """Serve an adapter built in memory (the weight transfer's, ``engine/app.py``) under its name, in
        place of one of that name; EngineError 400 when its name or rank cannot be served."""
        async with self._adapter_lock:
            if adapter.name in self.names:
                raise EngineError(400, f"The lora adapter name '{adapter.name}' conflicts with a served base model.",
                                  "lora_name", "InvalidUserInput")
            await self._install(adapter)

    async def _install(self, adapter: Adapter) -> None:
        if self.max_lora_rank is not None and adapter.rank > self.max_lora_rank:  # vLLM's words
            raise EngineError(400, f"LoRA rank {adapter.rank} is greater than max_lora_rank {self.max_lora_rank}.", None,
                              "BadRequestError")
        old = self.adapters.get(adapter.name)
        await asyncio.to_thread(self.batcher.between_steps, lambda: self.adapters.hook(adapter))
        self.adapters.add(adapter)  # on the event loop, where requests look names up
        if old is not None:  # in place: running requests keep the old tensors, new ones get the new
            await asyncio.to_thread(self.batcher.forget_adapter, old)
        log.info("loaded LoRA adapter %r from %s (r=%d, %d modules)", adapter.name, adapter.path, adapter.rank,
                 len(adapter.weights))

    async def load_static_adapters(self, settings: Settings) -> None:
        """``--lora-modules``: whoever builds the engine loads them before serving it (as vLLM does), and
        stops if one fails (RuntimeError naming it)."""
        for name, path in self.options.lora_modules:
            try:
                await self.load_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=path), settings)
            except EngineError as e:
                raise RuntimeError(f"--lora-modules {name}={path}: {e.message}") from None

    async def unload_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        """Remove the name at once; requests already admitted with it finish with its tensors."""
        async with self._adapter_lock:
            return await self._unload_adapter(req)

    async def _unload_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        if not req.lora_name and req.lora_int_id is None:
            raise EngineError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", None, "InvalidUserInput")
        adapter = self.adapters.remove(req.lora_name)
        if adapter is None:
            raise EngineError(404, f"The lora adapter '{req.lora_name}' cannot be found.", None, "NotFoundError")
        await asyncio.to_thread(self.batcher.forget_adapter, adapter)
        log.info("unloaded LoRA adapter %r (%d requests still running with it)", req.lora_name, self.batcher.in_use(adapter))
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def model_cards(self) -> list[dict[str, Any]]:
        """/v1/models: the base aliases, then every adapter with the base as its parent (vLLM's cards)."""
        base = [{"id": n, "object": "model", "created": self.created, "owned_by": "polarstream", "root": self.lm.path,
                 "parent": None, "max_model_len": self.max_model_len, "permission": [],
                 # Ours only (vLLM does not report it): which logprobs it returns, so a gateway can check.
                 "logprobs_mode": self.options.logprobs_mode} for n in self.names]
        loras = [{"id": a.name, "object": "model", "created": self.created, "owned_by": "polarstream", "root": a.path,
                  "parent": self.names[0], "max_model_len": None, "permission": [],
                  "logprobs_mode": self.options.logprobs_mode} for a in self.adapters.loaded.values()]
        return base + loras

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        M = self.max_model_len
        if len(text) > M * self.max_token_chars:
            raise EngineError(400, f"This model's maximum context length is {M} tokens. However, your prompt contains "
                                   f"{len(text)} characters (more than {M * self.max_token_chars} characters, which is the "
                                   f"upper bound for {M} input tokens). Please reduce the length of the input prompt.", "input_text")
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise bad_param("prompt", ids, "The decoder prompt cannot be empty")
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise bad_param("prompt", i, f"Token id {i} is out of vocabulary")

    def room(self, ids: list[int], from_text: bool, max_tokens: int | None, param: str) -> int:
        """Output budget for a prompt, or vLLM's context-length errors."""
        M, N = self.max_model_len, len(ids)
        if max_tokens is not None and max_tokens > M:
            raise bad_param(param, max_tokens, f"{param}={max_tokens} cannot be greater than max_model_len={M}. "
                                              "Please request fewer output tokens.")
        if N > M:
            # text prompts are tokenized with truncation at M + 1, so vLLM only knows "at least M + 1"
            n = M + 1 if from_text else N
            at_least = "at least " if n == M + 1 else ""
            raise bad_param("input_tokens", n, f"This model's maximum context length is {M} tokens. However, your prompt "
                                               f"contains {at_least}{n} input tokens, which exceeds this limit even without any "
                                               "output tokens. Please reduce the length of the input prompt.")
        if N == M:
            raise bad_param("max_tokens", 0, "max_tokens must be at least 1, got 0.")
        return M - N if max_tokens is None else min(max_tokens, M - N)

    def make_job(self, ids: list[int], params: SamplingParams, n: int, adapter: Adapter | None = None) -> Job:
        if n > self.batcher.max_num_seqs:  # it could never be admitted
            raise bad_param("n", n, f"n must be at most {self.batcher.max_num_seqs} (the engine's --max-num-seqs), got {n}.")
        forced = None
        if self.script is not None:
            out = self.script.choose(self.tokenizer.decode(ids, skip_special_tokens=False))
            if out is not None:
                forced = self.tokenizer(out, add_special_tokens=False)["input_ids"]
                if not forced or forced[-1] not in self.lm.eos_token_ids:  # a raw turn may end in its own stop
                    forced.append(self.lm.eos_token_ids[0])
        seqs = []
        for i in range(n):
            p = with_seed(params, i)
            gen = torch.Generator(self.batcher.device).manual_seed(p.seed) if p.seed is not None else None
            seqs.append(Sequence(len(ids), p, forced=forced, generator=gen))
        return Job(list(ids), seqs, adapter=adapter)

    async def run(self, jobs: list[Job]) -> list[Job]:
        """Submit jobs and wait for all; a cancelled request (client gone) aborts its sequences."""
        if self.script is not None and self.script.delay_s:
            await asyncio.sleep(self.script.delay_s)  # the script's slow model (a client leaving cancels it)
        futures = []
        try:
            for j in jobs:
                futures.append(asyncio.wrap_future(self.batcher.submit(j)))
        except Refused as e:  # paused by a client (wait/abort) or shutting down: vLLM answers 503
            for j in jobs:
                j.cancelled = True
            raise EngineError(503, str(e)) from None
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for j in jobs:
                j.cancelled = True
            raise

    # ------------------------------------------------------------------ endpoints

    async def completions(self, req: CompletionRequest, request_id: str | None = None) -> tuple[dict[str, Any], int]:
        """/v1/completions -> (body, policy version)."""
        model = self.check_model(req.model)
        adapter = self.resolve(req.model)
        if req.stream:
            raise bad_param("stream", True, "stream is not supported by this engine")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        base = req.sampling(max_tokens, req.logprobs)  # validates every sampling field first
        jobs = []
        for p in req.prompts():  # tokenize and check every prompt before submitting any
            ids = self.encode_text(p, req.add_special_tokens) if isinstance(p, str) else list(p)
            self.check_ids(ids)
            room = self.room(ids, isinstance(p, str), max_tokens, "max_tokens")
            jobs.append(self.make_job(ids, replace(base, max_tokens=room), req.n, adapter))
            jobs[-1].prompt_logprobs = req.prompt_logprobs
        done = await self.run(jobs)
        version = max(j.policy_version for j in done)
        body = completion_body(request_id or secrets.token_hex(8), model, [(j.prompt_ids, j.seqs, j.prompt_scores) for j in done],
                               logprobs=req.logprobs is not None, return_token_ids=req.return_token_ids,
                               return_weight_versions=req.return_weight_versions,
                               text_of=TokenText(self.tokenizer, req.return_tokens_as_token_ids), policy_version=version)
        return body, version

    def render_chat(self, req: ChatRequest) -> str:
        """The chat prompt as text, rendered like vLLM does before tokenizing."""
        if req.add_generation_prompt and req.continue_final_message:
            raise EngineError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if req.tools is not None and not req.tools:
            raise bad_param("tools", [], "tools cannot be an empty list; omit it instead")
        kwargs = {**(req.chat_template_kwargs or {})}
        try:
            return self.tokenizer.apply_chat_template(
                normalize_messages(req.messages), tools=req.tools or None, documents=req.documents,
                chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False, **kwargs)
        except EngineError:
            raise
        except Exception as e:  # a template error is the request's fault (bad roles, missing content...)
            raise EngineError(400, f"chat template failed on this conversation: {e}", "messages") from None

    def tool_mode(self, req: ChatRequest) -> bool:
        """Whether tool calls are parsed from the output (vLLM with --tool-call-parser hermes)."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice not in ("auto", "none"):
            raise bad_param("tool_choice", choice, "only tool_choice 'auto' and 'none' are supported by this engine "
                                                   "(no guided decoding)")
        return bool(req.tools) and choice == "auto"

    async def chat(self, req: ChatRequest, request_id: str | None = None) -> tuple[dict[str, Any], int]:
        """/v1/chat/completions -> (body, policy version)."""
        model = self.check_model(req.model)
        adapter = self.resolve(req.model)
        if req.stream:
            raise bad_param("stream", True, "stream is not supported by this engine")
        parse_tools = self.tool_mode(req)
        param, max_tokens = req.max_tokens_param()
        k = req.requested_logprobs()
        # vLLM's hermes parser keeps special tokens in the text when tools are on
        base = req.sampling(1 if max_tokens is None else max_tokens, k, skip_special_tokens=not parse_tools)
        prompt = self.render_chat(req)
        ids = self.encode_text(prompt, req.add_special_tokens)
        self.check_ids(ids)
        room = self.room(ids, True, max_tokens, param)
        (job,) = await self.run([self.make_job(ids, replace(base, max_tokens=room), req.n, adapter)])
        text_of = TokenText(self.tokenizer, req.return_tokens_as_token_ids)
        choices = [chat_choice(i, s, parse_tools=parse_tools, logprobs_k=k, return_token_ids=req.return_token_ids,
                               return_weight_versions=req.return_weight_versions, text_of=text_of,
                               policy_version=job.policy_version) for i, s in enumerate(job.seqs)]
        body = chat_body(request_id or secrets.token_hex(8), model, ids, choices, sum(len(s.token_ids) for s in job.seqs),
                         return_token_ids=req.return_token_ids, prompt_text=prompt if req.return_prompt_text else None,
                         policy_version=job.policy_version)
        return body, job.policy_version


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM does to messages before rendering a string-format template.

    Text-part lists are joined with newlines, null content becomes "", and tool-call ``arguments``
    JSON strings become dicts (invalid JSON becomes {}), so templates print them as JSON once.
    """
    import json

    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise bad_param("messages", m, "each message must be an object with a 'role'")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
        elif content is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        fn["arguments"] = {}
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out
