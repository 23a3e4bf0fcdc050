"""Dynamic batching: one background thread runs the model; requests join and leave at step boundaries.

Each step the thread (1) admits waiting jobs: every job (one prompt, ``n`` choices) is prefilled on its
own, unpadded and causal, and its first tokens are chosen from the prefill's last logits; (2) runs one
batched decode step for every live sequence over the shared left-padded KV cache (``engine/kv.py``);
(3) retires finished sequences and resolves their jobs' futures. HTTP handlers never touch the model:
they submit a ``Job`` and await its future.

Scripted jobs (every choice teacher-forced, ``engine/script.py``) may skip the prompt's prefill: with
``script_window`` > 0 one forward pass over the prompt's last ``script_window`` tokens followed by the
forced tokens scores every forced token at once, and the job never joins the decode batch. Those
logprobs are conditioned on the window only (labelled as such in docs/engine.md): a test-speed mode for
40-80 KB harness prompts on a CPU, never a training signal.

Pausing holds new jobs in the queue: ``wait`` lets running sequences finish (drain), ``abort`` ends
them with ``finish_reason="abort"``, ``keep`` freezes them where they are. Weight swaps happen under
the step lock, so no step ever sees half-updated weights.

A job may name a LoRA adapter (``engine/lora.py``): its prefill runs with that adapter, and each
decode step tells the adapter hooks which adapter each row uses, so one batch mixes adapters and the
base. Prefix-cache entries are kept per adapter (KV computed with one adapter is wrong for another).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kv import BatchKV, cache_of, layers_of
from .lora import Adapter, Adapters
from .prompt_logprobs import prompt_logprobs
from .prefix_cache import PrefixCache
from .sampling import LOGPROBS_MODES, SamplingParams, draw, perturb, process, top_logprobs

log = logging.getLogger("polarstream.engine")


PAUSED = "Generation is paused. Please retry after it resumes."  # vLLM 0.33's (v1/engine/core.py), a 503


class Refused(RuntimeError):
    """A job refused at submission: the engine is paused (wait/abort) or shutting down."""


@dataclass(eq=False)
class Sequence:
    """One choice being generated: its parameters and everything produced so far."""

    prompt_len: int
    params: SamplingParams
    forced: list[int] | None = None  # scripted mode: the tokens to emit (teacher forcing)
    generator: torch.Generator | None = None  # per-request seed
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    text: str = ""  # final text, set when finished
    job: "Job | None" = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Job:
    """One prompt and its ``n`` sequences; ``future`` resolves to the job itself when all are done."""

    prompt_ids: list[int]
    seqs: list[Sequence]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    policy_version: int = -1  # weights that generated it, set at admission
    adapter: Adapter | None = None  # the LoRA adapter it runs with (None: the base model)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: score every prompt token (prompt_logprobs.py)
    prompt_scores: list | None = None  # set at prefill when prompt_logprobs is asked for
    cancelled: bool = False
    _left: int = 0


def default_threads(model: torch.nn.Module) -> int:
    """CPU threads for the engine thread: 1 for tiny models, whose small matmuls lose more to thread
    synchronisation than they gain (10x slower decode steps on a busy 2-core machine); else torch's."""
    return 1 if sum(p.numel() for p in model.parameters()) < 20_000_000 else torch.get_num_threads()


class Batcher:
    """Owns the model while serving; thread-safe ``submit``/``pause``/``resume``/``swap_weights``."""

    logit_noise = 0.0  # --logit-noise: sampling.perturb's sigma (set by serving.Engine)

    def __init__(self, model, tokenizer, eos_token_ids: list[int], *, max_num_seqs: int = 64,
                 logprobs_mode: str = "processed_logprobs", seed: int = 0, policy_version: int = 0,
                 threads: int = 0, prefix_cache_bytes: int = 256 << 20, script_window: int = 0,
                 adapters: Adapters | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.eos_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos = frozenset(eos_token_ids[1:])  # generation_config's: reported as stop_reason ids
        self.max_num_seqs, self.logprobs_mode = max_num_seqs, logprobs_mode
        self.threads = threads or default_threads(model)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.script_window = script_window
        self.policy_version = policy_version
        self.adapters = adapters if adapters is not None else Adapters(model)
        self._default_gen = torch.Generator(self.device).manual_seed(seed)
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()
        self._pending: deque[Job] = deque()
        self._rows: list[Sequence] = []
        self._kv: BatchKV | None = None
        self._cache = None
        self._hold = self._freeze = self._abort = self._stop = False
        self.pause_mode: str | None = None  # the mode of the pause in force
        self.refusing = False  # a client's wait/abort pause: new jobs are refused (vLLM's 503), not queued
        self.refusal = PAUSED
        self._thread: threading.Thread | None = None
        # counters for tests and benchmarks: how much batching actually happened
        self.stats = {"prefills": 0, "prefill_tokens": 0, "prefix_hit_tokens": 0, "decode_steps": 0,
                      "decoded_tokens": 0, "max_rows": 0,
                      "scripted_window_jobs": 0, "busy_s": 0.0}  # busy_s: seconds spent in steps (generation in flight)

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread:
            self._thread.join(timeout=30)

    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queue ``job``; Refused while a client's ``wait``/``abort`` pause is in force."""
        job._left = len(job.seqs)
        for s in job.seqs:
            s.job = job
        with self._cv:
            if self.refusing:
                raise Refused(self.refusal)
            self._pending.append(job)
            self._cv.notify_all()
        return job.future

    @property
    def paused(self) -> bool:
        return self._hold

    @property
    def running(self) -> int:
        return len(self._rows)

    def pause(self, mode: str = "wait", timeout: float | None = None, refuse: bool = False) -> None:
        """Hold new jobs; ``wait``: drain running ones, ``abort``: end them, ``keep``: freeze them. ``refuse``
        (a client's ``/pause`` in wait or abort mode, as vLLM): new jobs are refused until ``resume`` instead
        of waiting in the queue; an internal pause (a weight swap) holds them."""
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause mode must be wait, abort or keep, got {mode!r}")
        with self._cv:
            self._hold = True
            self.pause_mode = mode
            self.refusing = self.refusing or (refuse and mode != "keep")
            self._freeze = mode == "keep"
            self._abort = mode == "abort"
            self._cv.notify_all()
            if mode != "keep" and not self._cv.wait_for(lambda: not self._rows, timeout):
                raise TimeoutError("in-flight requests did not finish in time")
        if mode == "keep":
            with self._step_lock:  # the step in progress, if any, has ended
                pass

    def resume(self) -> None:
        with self._cv:
            self._hold = self._freeze = self._abort = self.refusing = False
            self.pause_mode = None
            self._cv.notify_all()

    def shut(self, err: Exception) -> None:
        """The server is stopping: fail every queued job with ``err`` and end the running ones (``abort``), so
        no request is left waiting on a paused or frozen engine and the server's shutdown can finish. Paused
        for good: nothing is admitted after this."""
        with self._cv:
            self._hold, self._freeze, self._abort, self.pause_mode = True, False, True, "abort"
            self.refusing, self.refusal = True, str(err)
            queued, self._pending = list(self._pending), deque()
            self._cv.notify_all()
        for job in queued:
            if not job.future.done():
                job.future.set_exception(err)

    def swap_weights(self, apply: Callable[[torch.nn.Module], None], version: int) -> None:
        """Run ``apply(model)`` between steps and make ``version`` the reported policy version."""
        with self._step_lock:
            apply(self.model)
            self.policy_version = version
            if self.prefix is not None:
                self.prefix.clear()  # cached KV was computed by the old weights

    def between_steps(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` while no step runs (adapter hooks and tables must not change mid-forward)."""
        with self._step_lock:
            fn()

    def in_use(self, adapter: Adapter) -> int:
        """Jobs queued or running with ``adapter``."""
        with self._cv:
            jobs = {id(j): j for j in self._pending} | {id(s.job): s.job for s in self._rows}
        return sum(1 for j in jobs.values() if j.adapter is adapter)

    def forget_adapter(self, adapter: Adapter) -> None:
        """Drop the prefix-cache entries computed with ``adapter`` (between steps)."""
        if self.prefix is not None:
            self.between_steps(lambda: self.prefix.drop_namespace(adapter))

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)  # OpenMP: this thread's setting only, not the process's
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._has_work())
                if self._stop:
                    break
                admit: list[Job] = []
                if not self._hold:
                    room = self.max_num_seqs - len(self._rows)
                    while self._pending and len(self._pending[0].seqs) <= room:
                        room -= len(self._pending[0].seqs)
                        admit.append(self._pending.popleft())
                abort = self._abort
            t0 = time.perf_counter()
            try:
                with self._step_lock, torch.inference_mode():
                    self._step(admit, abort)
            except Exception as e:  # a failed step fails its requests, never the server
                log.exception("engine step failed")
                self._fail_all(admit, e)
            self.stats["busy_s"] += time.perf_counter() - t0
            with self._cv:
                self._cv.notify_all()  # pause() may be waiting for the batch to drain

    def _has_work(self) -> bool:
        if self._freeze:
            return False
        return bool(self._rows) or (bool(self._pending) and not self._hold)

    def _step(self, admit: list[Job], abort: bool) -> None:
        for s in self._rows:
            if abort or s.job.cancelled:
                self._finish(s, "abort", None)
        for job in admit:
            job.policy_version = self.policy_version
            if job.cancelled:
                for s in job.seqs:
                    self._finish(s, "abort", None)
            elif self.script_window > 0 and all(s.forced for s in job.seqs) and job.prompt_logprobs is None:
                self._score_scripted(job)
            else:
                self._prefill(job)
        live = [s for s in self._rows if not s.finished]
        if len(live) < len(self._rows):
            self._set_rows(live)
        if self._rows:
            self._decode()
            self._set_rows([s for s in self._rows if not s.finished])

    def _prefill(self, job: Job) -> None:
        prompt = job.prompt_ids
        scored = job.prompt_logprobs is not None  # every position's logits: no cached prefix (vLLM skips it too)
        m, past = self.prefix.lookup(prompt, job.adapter) if self.prefix is not None and not scored else (0, None)
        ids = torch.tensor([prompt[m:]], device=self.device)
        with self.adapters.rows([job.adapter]):
            if m:  # only the new suffix is computed, on top of the cached KV of the first m tokens
                pos = torch.arange(m, len(prompt), device=self.device)[None]
                out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache_of(past), use_cache=True, logits_to_keep=1)
            else:
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if scored else 1)
        if scored:
            job.prompt_scores = prompt_logprobs(out.logits[0], prompt, job.prompt_logprobs)
        layers = layers_of(out.past_key_values)
        st = self.stats
        st["prefills"] += 1
        st["prefill_tokens"] += len(prompt) - m
        st["prefix_hit_tokens"] += m
        if self.prefix is not None:
            self.prefix.put(prompt, layers, job.adapter)
        self._choose(job.seqs, out.logits[:, -1].expand(len(job.seqs), -1))
        live = [s for s in job.seqs if not s.finished]
        if live:
            kv = BatchKV.single(layers, len(live))
            self._kv = kv if self._kv is None else self._kv.join(kv)
            self._rows = self._rows + live
            self._cache = cache_of(self._kv.layers)

    def _score_scripted(self, job: Job) -> None:
        """A forced job in one pass over (last ``script_window`` prompt tokens + forced tokens).

        Position ids continue the real prompt's, so the window sees the positions it would in a full
        prefill; the logits at window end + t score forced token t, chosen through ``_choose`` exactly
        as a decode step would (temperature, min_tokens, stop strings and max_tokens all apply).
        """
        forced = job.seqs[0].forced
        assert forced is not None
        prompt = job.prompt_ids
        start = max(0, len(prompt) - self.script_window)
        ids = prompt[start:] + forced[:-1]
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        # Only the last len(forced) positions are scored: the last prompt token's logits predict forced[0].
        with self.adapters.rows([job.adapter]):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), position_ids=pos, use_cache=False,
                             logits_to_keep=len(forced))
        self.stats["scripted_window_jobs"] += 1
        for t in range(len(forced)):
            live = [s for s in job.seqs if not s.finished]
            if not live:
                break
            self._choose(live, out.logits[:, t].expand(len(live), -1))
        for s in job.seqs:  # a forced script always ends in EOS; this is a guard, not a path
            if not s.finished:
                self._finish(s, "length", None)

    def _decode(self) -> None:
        rows, kv = self._rows, self._kv
        ids = torch.tensor([[s.token_ids[-1]] for s in rows], device=self.device)
        # the position of each row's last token: the padding in front of it does not count
        pos = torch.tensor([[s.prompt_len + len(s.token_ids) - 1] for s in rows], device=self.device)
        mask = torch.cat([kv.mask, torch.ones(len(rows), 1, dtype=kv.mask.dtype, device=self.device)], dim=1)
        with self.adapters.rows([s.job.adapter for s in rows]):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=self._cache, use_cache=True)
        st = self.stats
        st["decode_steps"] += 1
        st["decoded_tokens"] += len(rows)
        st["max_rows"] = max(st["max_rows"], len(rows))
        self._kv = BatchKV(layers_of(self._cache), mask)
        self._choose(rows, out.logits[:, -1])

    def _set_rows(self, live: list[Sequence]) -> None:
        if len(live) == len(self._rows):
            return  # nobody finished: the cache the model just extended stays as it is
        if self.prefix is not None:
            for i, s in enumerate(self._rows):
                if s.finished and len(s.token_ids) > 1:
                    # the row's KV covers prompt + output minus the last token (never fed back)
                    n = int(self._kv.mask[i].sum())
                    self.prefix.put(s.job.prompt_ids + s.token_ids[:-1],
                                    [(k[i: i + 1, :, -n:], v[i: i + 1, :, -n:]) for k, v in self._kv.layers], s.job.adapter)
        if not live:
            self._rows, self._kv, self._cache = [], None, None
            return
        keep = [i for i, s in enumerate(self._rows) if not s.finished]
        self._kv = self._kv.select(keep)
        self._cache = cache_of(self._kv.layers)
        self._rows = live

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Pick each row's next token (sampled or forced) and record it with its logprobs."""
        dev = self.device
        raw = perturb(logits.float(), self.logit_noise, self._default_gen)
        masked = raw
        for i, s in enumerate(seqs):
            if len(s.token_ids) < s.params.min_tokens:  # EOS/stop ids may not end the output yet
                if masked is raw:
                    masked = raw.clone()
                masked[i, list(self._stop_ids(s))] = float("-inf")
        forced = [s.forced is not None for s in seqs]
        # Forced (scripted) rows: temperature only. Their tokens were not chosen by truncated sampling,
        # and a -inf logprob for a token outside top-k/top-p would poison training.
        temp = torch.tensor([s.params.temperature for s in seqs], device=dev)
        top_k = torch.tensor([0 if f else s.params.top_k for s, f in zip(seqs, forced)], device=dev)
        top_p = torch.tensor([1.0 if f else s.params.top_p for s, f in zip(seqs, forced)], device=dev)
        processed = process(masked, temp, top_k, top_p)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        tokens = draw(processed, greedy, [s.generator for s in seqs], self._default_gen)
        for i, s in enumerate(seqs):
            if s.forced is not None and len(s.token_ids) < len(s.forced):
                tokens[i] = s.forced[len(s.token_ids)]
        want = [s.params.logprobs for s in seqs]
        tops: list = [None] * len(seqs)
        if any(k is not None for k in want):
            source = processed if self.logprobs_mode == "processed_logprobs" else raw
            tops = top_logprobs(source.log_softmax(dim=-1), tokens, [k or 0 for k in want])
        for s, tok, top in zip(seqs, tokens.tolist(), tops):
            self._accept(s, tok, top)

    def _stop_ids(self, s: Sequence) -> set[int]:
        ids = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            ids |= self.extra_eos | ({self.eos_id} if self.eos_id is not None else set())
        return ids

    def _accept(self, s: Sequence, tok: int, top: list[tuple[int, float]] | None) -> None:
        s.token_ids.append(tok)
        if top is not None:
            s.logprobs.append(top[0][1])
            s.top.append(top)
        p, n = s.params, len(s.token_ids)
        if n >= p.min_tokens:  # like vLLM, no stop condition applies before min_tokens
            if not p.ignore_eos and tok == self.eos_id:
                return self._finish(s, "stop", None)
            if (not p.ignore_eos and tok in self.extra_eos) or tok in p.stop_token_ids:
                return self._finish(s, "stop", tok)
            if p.stop:
                text = self.tokenizer.decode(s.token_ids, skip_special_tokens=p.skip_special_tokens)
                hits = [(text.find(x), x) for x in p.stop if x in text]
                if hits:
                    at, x = min(hits)
                    s.text = text[: at + len(x)] if p.include_stop_str_in_output else text[:at]
                    s.finish_reason, s.stop_reason = "stop", x
                    return self._done(s)
        if n >= p.max_tokens:
            return self._finish(s, "length", None)
        if s.forced is not None and n >= len(s.forced):
            return self._finish(s, "stop", None)

    def _finish(self, s: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if s.finished:
            return
        ids = s.token_ids
        # A stop token's own text is not part of the output (vLLM), unless asked for a stop_token_ids hit.
        by_token = reason == "stop" and bool(ids) and (
            (stop_reason is None and ids[-1] == self.eos_id)
            or (isinstance(stop_reason, int) and not s.params.include_stop_str_in_output))
        s.text = self.tokenizer.decode(ids[:-1] if by_token else ids, skip_special_tokens=s.params.skip_special_tokens)
        s.finish_reason, s.stop_reason = reason, stop_reason
        self._done(s)

    def _done(self, s: Sequence) -> None:
        job = s.job
        job._left -= 1
        if job._left == 0 and not job.future.done():
            job.future.set_result(job)

    def _fail_all(self, admit: list[Job], err: Exception) -> None:
        jobs = {s.job for s in self._rows} | set(admit)
        self._rows, self._kv, self._cache = [], None, None
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(err)
