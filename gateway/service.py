"""One model call through the gateway, start to finish.

    chain lock ─▶ pause gate ─▶ prompt ids (token-in/token-out) ─▶ engine ─▶ decode + parse
        ─▶ CallRecorded ─▶ (publish lock: call_index) durable publish ─▶ advance session state ─▶ ChatResponse

The session's state (call_index, chain tip, counters) advances only once its event is in Kafka (sync
mode). A call the engine side fails (render error, context length, upstream timeout or transport
failure, engine rejection or abort) is recorded too, with ``error`` set and nothing sampled, before the
harness gets its error: it takes a call_index but never becomes a chain tip, so the retry extends the
last answered call. A call refused because the event log is down is, necessarily, not recorded. If the
broker does not confirm within ``publish_timeout_s`` the harness gets a 503 at once; the publish keeps
going in the background and the session refuses further calls until its outcome is known, so the
state always agrees with what is in the topic.

Runs: a session's key names its run (the ``run`` claim: the run's topic prefix, '' = this gateway's
own). Each run has its own stamp (``RunPolicy``: the policy version and, for LoRA, the adapter name the
trainer set through /admin/policy_version), and its calls are recorded under its own topic prefix. A
LoRA run's calls go to the engine with ``model`` = its current adapter, whatever the harness named,
and are stamped with that adapter's version: the engine reports its base weights' version only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from schemas import CallRecorded, EngineSampling, new_event_id
from schemas.session_keys import SessionClaims

from . import errors, metrics
from .canonical import ChatRequest, ChatResponse, ContextLengthError, RequestError
from .config import GatewayConfig
from .events import build_call_record, build_failed_record
from .gate import Gate, GateClosed
from .redact import Redactor, token_decoder
from .sessions import ChainSlot, SessionClosed, SessionState, SessionStore, Turn, tip_key
from .template import ChatTemplate, TemplateError, TurnHistory
from .tokens import PromptPlan, plan_prompt
from .tombstones import TombstoneFile
from .toolparse import ParsedOutput, choose
from .upstream import GenerateParams, Generation, Upstream, UpstreamBadResponse, UpstreamError

log = logging.getLogger("polarstream.gateway")


class Publisher(Protocol):
    async def publish(self, record: Any) -> Any: ...


@dataclass(frozen=True)
class RunPolicy:
    """What the gateway stamps on a run's calls; read once per call, so the version and the adapter
    that served the call always agree."""

    version: int = 0
    lora_name: str = ""  # '' = the engine's base model (full-weight training)


@dataclass
class PendingPublish:
    """A publish that outlived its wait: applied to the session state if and when it succeeds."""

    task: asyncio.Future
    apply: Callable[[], None]

    def done(self) -> bool:
        """Whether the broker has answered (the outcome is applied right after)."""
        return self.task.done()


class Gateway:
    """The gateway's working parts; one per process, built by ``create_app``."""

    def __init__(self, config: GatewayConfig, template: ChatTemplate):
        self.config = config
        self.template = template
        # the served model's tool-call and reasoning markup (ParserChoiceError, one line, when unknown)
        self.parsers = choose(template.signature(), config.tool_parser, config.reasoning_parser)
        # how later prompts keep the turns the model wrote (template.py)
        self.turns = TurnHistory(config.history, self.parsers.split_reasoning)
        self.sessions = SessionStore(config.max_sessions, tombstones=TombstoneFile(config.tombstones) if config.tombstones else None)
        self.gate = Gate()
        self.runs: dict[str, RunPolicy] = {"": RunPolicy(config.policy_version)}  # run ('' = own) -> its stamp
        self.topic_prefix = ""  # this gateway's own run (create_app sets it from the settings)
        self.upstream: Upstream | None = None  # set in the app's lifespan
        self.publisher: Publisher | None = None  # this gateway's own run's
        self.publisher_for_prefix: Callable[[str], Publisher] | None = None  # another run's (create_app sets it)
        self.run_publishers: dict[str, Publisher] = {}
        self.adapters_in_flight: dict[str, int] = {}  # adapter name -> calls at the engine now
        self.served_model = config.served_model or config.model
        self.max_model_len = config.max_model_len
        self.kafka_stalled = False  # a publish timed out and is unresolved: refuse calls quickly
        self.counters = {"calls": 0, "errors": 0, "publish_failures": 0}
        self.redactor = Redactor(config.redact)  # create_app keys its placeholders with the session secret
        self._decode_one = token_decoder(getattr(template, "tokenizer", None))

    # -- runs and their stamps ----------------------------------------------------------------------

    def run_key(self, run: str) -> str:
        """'' for this gateway's own run (its own topic prefix named explicitly included)."""
        return "" if run == self.topic_prefix else run

    def policy(self, run: str = "") -> RunPolicy:
        """The stamp of ``run``; a run never stamped starts at the configured version, on the base model."""
        return self.runs.get(self.run_key(run)) or RunPolicy(self.config.policy_version)

    def stamp(self, version: int, lora_name: str = "", run: str = "") -> RunPolicy:
        """Stamp ``version`` (served by adapter ``lora_name``, '' = base) on ``run``'s later calls."""
        self.runs[self.run_key(run)] = p = RunPolicy(version, lora_name)
        return p

    @property
    def policy_version(self) -> int:
        """This gateway's own run's version."""
        return self.runs[""].version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.runs[""] = RunPolicy(version, self.runs[""].lora_name)

    def publisher_of(self, run: str) -> Publisher:
        """The publisher recording ``run``'s calls (its topic prefix); made on first use."""
        key = self.run_key(run)
        if key == "":
            assert self.publisher is not None, "gateway used outside its lifespan"
            return self.publisher
        if key not in self.run_publishers:
            if self.publisher_for_prefix is None:
                raise errors.unavailable(f"this gateway records only its own run; a key of run {key!r} cannot be "
                                         "recorded", self.config.retry_after_s)
            self.run_publishers[key] = self.publisher_for_prefix(key)
        return self.run_publishers[key]

    # -- public -----------------------------------------------------------------------------------

    async def count_tokens(self, req: ChatRequest) -> int:
        """Prompt tokens of ``req`` rendered afresh (what a harness budgets with; not recorded)."""
        req, _ = self.redactor.scrub_request(req)  # count what the model will see: placeholders, not secrets
        try:
            ids = await asyncio.to_thread(self.template.prompt_ids, req.messages, req.tools, reasoning=req.reasoning)
        except TemplateError as e:
            raise RequestError(400, str(e)) from None
        return len(ids)

    async def call(self, claims: SessionClaims, req: ChatRequest, harness: str = "") -> ChatResponse:
        """Generate, record and answer one call of session ``claims``; raises RequestError."""
        try:
            st = self.sessions.get(claims)
        except SessionClosed as e:
            err = errors.unauthorized(str(e))
            metrics.record_error(err.kind)
            raise err from None
        key = tip_key(req)  # of the request as sent: scrubbing is deterministic per session
        try:
            async with st.chain(key) as slot:
                self._refuse_if_unrecordable(st)
                async with self.gate.enter(self.config.hold_timeout_s):
                    return await self._call_locked(st, key, slot, req, harness)
        except GateClosed as e:
            err = errors.unavailable(str(e), self.config.retry_after_s)
            metrics.record_error(err.kind)
            raise err from None
        except RequestError as e:
            st.failed += 1
            self.counters["errors"] += 1
            metrics.record_error(e.kind)
            raise

    # -- the pipeline -----------------------------------------------------------------------------

    def _refuse_if_unrecordable(self, st: SessionState) -> None:
        _settle(st)
        if st.pending is not None:
            raise errors.unavailable("the previous call of this session is still being recorded (event log "
                                     "unavailable); retry later", self.config.retry_after_s)
        if self.kafka_stalled:
            raise errors.unavailable("event log unavailable: calls cannot be recorded; retry later",
                                     self.config.retry_after_s)

    async def _call_locked(self, st: SessionState, key: tuple, slot: ChainSlot, req: ChatRequest,
                           harness: str) -> ChatResponse:
        received_at, t0 = time.time(), time.perf_counter()
        # Credentials are scrubbed before tokenizing: neither the engine nor any recorded id sees them.
        req, scrubbed = self.redactor.scrub_request(req, slot.memo)
        marks = [t0, time.perf_counter()]  # the end of each stage (metrics.STAGES)
        if not req.side_call and st.main is not None and side_call_by_shape(req, st.main):
            req = dataclasses.replace(req, side_call=True)
        plan = PromptPlan([])
        prev = None if req.side_call else st.tip_for(key)
        try:
            try:  # whole renders in a worker thread: tokenizing a fresh 80 KB prompt must not stall other sessions' calls
                plan = (plan_prompt(self.template, prev, req, cheap_only=True, turns=self.turns)
                        or await asyncio.to_thread(plan_prompt, self.template, prev, req, turns=self.turns))
            except TemplateError as e:
                raise RequestError(400, str(e)) from None
            marks.append(time.perf_counter())
            if st.evicted and plan.break_reason == "first_call":
                plan.break_reason = "state_evicted"
            sampling = self.config.sampling.effective(req.sampling, st.claims)
            run = self.policy(st.claims.run)  # read once: the adapter called and the version stamped agree
            gen = await self._generate(st, req, plan, sampling, run)
            marks.append(time.perf_counter())
        except RequestError as e:
            # The harness sees this error: record it (nothing sampled, never trained on) before answering.
            await self._record_failure(st, prev, req, plan, scrubbed, harness, e, received_at, t0)
            raise
        parsed, finish, matched = self._interpret(req, gen)
        if run.lora_name:  # the engine reports its base weights' version; the adapter carries the policy's
            policy, served = run.version, run.lora_name
        else:
            policy = gen.policy_version if gen.policy_version is not None else run.version
            served = self.served_model
        record = build_call_record(  # call_index is provisional: the real one is assigned at publish
            claims=st.claims, call_index=st.next_call_index, req=req, plan=plan, gen=gen, parsed=parsed, finish_reason=finish,
            policy_version=policy, served_model=served, harness=harness, base=self._delta_base(st, plan, prev),
            received_at=received_at, total_ms=(time.perf_counter() - t0) * 1000, event_id=new_event_id(),
        )
        record.sampling = sampling
        await self._finish_record(record, scrubbed, plan)
        marks.append(time.perf_counter())
        # The tip remembers the turn as scrubbed: the harness's echo of it is scrubbed on the way in, so
        # a secret the model wrote itself must not make the echo differ (and break the chain).
        remembered = _as_recorded(parsed, record) if any(k.startswith("output.") for k in record.redactions) else parsed
        await self._publish(st, record, lambda i: _advance(st, key, req, plan, gen, remembered, i))
        marks.append(time.perf_counter())
        self.counters["calls"] += 1
        metrics.record_call(req.provider, "ok", marks[-1] - t0 - gen.upstream_ms / 1000)
        stages = [b - a for a, b in zip(marks, marks[1:])]
        stages[2] -= gen.upstream_ms / 1000  # the engine's own time is not the gateway's
        metrics.record_stages(stages)
        if plan.break_reason:
            metrics.record_chain_break(plan.break_reason)
        return ChatResponse(
            id=record.event_id, model=req.model, text=parsed.text, reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls, finish_reason=finish, matched_stop=matched,  # type: ignore[arg-type]
            prompt_tokens=len(plan.prompt_ids), completion_tokens=len(gen.completion_ids), created=received_at,
        )

    @staticmethod
    def _delta_base(st: SessionState, plan: PromptPlan, prev: Turn | None) -> tuple[int, list[int]] | None:
        """The call this prompt was built on (or repeats), else the session's latest answered call."""
        builds_on_prev = prev is not None and (plan.extends_call_index is not None or plan.break_reason == "retry")
        return (prev.call_index, prev.full_sequence) if builds_on_prev else st.last_call

    async def _finish_record(self, record: CallRecorded, scrubbed: Any, plan: PromptPlan) -> None:
        if scrubbed.counts:  # placeholder spans decode the whole prompt: off the event loop
            await asyncio.to_thread(self.redactor.finish_record, record, scrubbed, plan.prompt_ids, self._decode_one)
        else:
            self.redactor.finish_record(record, scrubbed, plan.prompt_ids, self._decode_one)

    async def _record_failure(self, st: SessionState, prev: Turn | None, req: ChatRequest, plan: PromptPlan,
                              scrubbed: Any, harness: str, err: RequestError, received_at: float, t0: float) -> None:
        """Publish the CallRecorded of a call answered with ``err`` (``error`` set, nothing sampled).

        It takes the next call_index, so the session's count includes it and the streams wait for it,
        but it never becomes a chain tip or a delta base: the next call extends the last answered one.
        If the event log cannot take it either, ``_publish`` raises its 503 instead of ``err``.
        """
        run = self.policy(st.claims.run)
        record = build_failed_record(
            claims=st.claims, call_index=st.next_call_index, req=req, plan=plan, error=f"{err.status} {err.kind}: {err.message}",
            policy_version=run.version, served_model=run.lora_name or self.served_model, harness=harness,
            base=self._delta_base(st, plan, prev) if plan.prompt_ids else None,
            received_at=received_at,
            total_ms=(time.perf_counter() - t0) * 1000, event_id=new_event_id(),
        )
        await self._finish_record(record, scrubbed, plan)
        await self._publish(st, record, lambda i: _advance_failed(st, i))
        metrics.record_call(req.provider, "error", time.perf_counter() - t0)

    async def _generate(self, st: SessionState, req: ChatRequest, plan: PromptPlan,
                        sampling: EngineSampling, run: RunPolicy) -> Generation:
        assert self.upstream is not None, "gateway used outside its lifespan"
        n = len(plan.prompt_ids)
        limit = self.max_model_len
        if limit is not None and n >= limit:
            raise ContextLengthError(n, limit)
        max_tokens = req.sampling.max_tokens or self.config.default_max_tokens
        if limit is not None:
            max_tokens = min(max_tokens, limit - n)
        s = req.sampling  # the harness's limits and stops; the distribution is ``sampling`` (gateway/sampling.py)
        # Every setting explicit, top_k 0 = off included: vLLM fills omitted ones from the model's
        # generation_config (e.g. top_k 20), which would truncate behind the record's back.
        params = GenerateParams(max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k, seed=s.seed, stop=list(s.stop))
        lora = run.lora_name
        if lora:
            self.adapters_in_flight[lora] = self.adapters_in_flight.get(lora, 0) + 1
        try:
            rid, st.next_request = f"{st.claims.session_id}-{st.next_request}", st.next_request + 1
            gen = await self.upstream.generate(plan.prompt_ids, params, request_id=rid, affinity=st.claims.session_id,
                                               model=lora)
            if lora and gen.model and gen.model != lora:
                raise UpstreamBadResponse(f"engine answered as model {gen.model!r}, not the adapter {lora!r} it was asked for")
        except UpstreamError as e:
            raise errors.from_upstream(e) from None
        finally:
            if lora:
                left = self.adapters_in_flight[lora] - 1
                if left:
                    self.adapters_in_flight[lora] = left
                else:
                    del self.adapters_in_flight[lora]
        if gen.finish_reason == "abort":  # e.g. the engine was paused with mode=abort for a weight swap
            raise errors.unavailable("generation aborted by the engine; retry", self.config.retry_after_s)
        return gen

    def _interpret(self, req: ChatRequest, gen: Generation) -> tuple[ParsedOutput, str, str]:
        text = self.template.decode_completion(gen.completion_ids)
        matched = gen.matched_stop
        if not matched and gen.finish_reason == "stop":
            matched = next((s for s in req.sampling.stop if s and s in text), "")
        if matched and matched in text:  # engines keep the stop string's ids; its text is not the answer
            text = text[: text.index(matched)]
        if req.tool_choice == "none" or not req.tools:
            # No tools offered (or tool use forbidden): markup is the model's text, as vLLM returns it.
            reasoning, rest = self.parsers.split_reasoning(text)
            parsed = ParsedOutput(text=rest, reasoning=reasoning)
        else:
            parsed = self.parsers.parse(text, req.tools)
        finish = gen.finish_reason if gen.finish_reason in ("stop", "length") else "stop"
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        return parsed, finish, matched

    async def _publish(self, st: SessionState, record: CallRecorded, advance: Callable[[int], None]) -> None:
        """Give ``record`` the session's next call_index, publish it and, once it is in Kafka, ``advance``.

        One publish per session at a time (``publish_lock``, held for the broker's ack only): indexes
        follow publish order and a refused publish leaves no hole, while chains generate in parallel."""
        async with st.publish_lock:
            self._refuse_if_unrecordable(st)  # another chain's publish may have stalled meanwhile
            record.call_index, record.boot_id = st.next_call_index, self.sessions.boot_id
            apply = functools.partial(advance, record.call_index)
            await self._publish_locked(st, record, apply)

    async def _publish_locked(self, st: SessionState, record: CallRecorded, apply: Callable[[], None]) -> None:
        task = asyncio.ensure_future(self.publisher_of(st.claims.run).publish(record))
        if self.config.publish_mode == "async":
            apply()  # optimistic: answer now, report a failed delivery in the log
            t_publish = time.perf_counter()
            task.add_done_callback(lambda t: self._report_async(t, record, t_publish))
            return
        t_publish = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(task), self.config.publish_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            # The record may still land: hold the session until we know, so state matches the topic.
            st.pending = PendingPublish(task, apply)
            task.add_done_callback(lambda t: self._settled(st))
            if isinstance(e, asyncio.CancelledError):  # the client went away mid-publish
                raise
            self.kafka_stalled = True
            raise errors.unavailable(f"event log did not confirm the call within {self.config.publish_timeout_s:g}s; "
                                     "retry later", self.config.retry_after_s) from None
        except Exception as e:  # the broker refused it: nothing was recorded
            self.counters["publish_failures"] += 1
            log.warning("publish of call %s/%d failed: %s", record.session_id, record.call_index, e)
            if getattr(e, "code", "") == "MSG_SIZE_TOO_LARGE":  # retrying cannot help: say so
                raise RequestError(413, f"the call is too large to record ({e}); shorten the conversation",
                                   "request_too_large") from None
            raise errors.unavailable(f"event log unavailable ({type(e).__name__}); retry later",
                                     self.config.retry_after_s) from None
        metrics.record_publish(time.perf_counter() - t_publish)
        apply()

    def _settled(self, st: SessionState) -> None:
        self.kafka_stalled = False  # the broker answered (one way or the other): try again
        _settle(st)

    def _report_async(self, task: asyncio.Future, record: CallRecorded, t_publish: float) -> None:
        if not task.cancelled() and task.exception() is None:
            metrics.record_publish(time.perf_counter() - t_publish)
        else:
            self.counters["publish_failures"] += 1
            log.error("async publish of call %s/%d failed: %s", record.session_id, record.call_index,
                      "cancelled" if task.cancelled() else task.exception())


def _settle(st: SessionState) -> None:
    """Apply a background publish's outcome once it is known (idempotent)."""
    p = st.pending
    if p is None or not p.task.done():
        return
    st.pending = None
    if not p.task.cancelled() and p.task.exception() is None:
        p.apply()
    else:
        st.failed += 1


def side_call_by_shape(req: ChatRequest, main: Turn) -> bool:
    """A call the adapters did not flag that is still not the main loop's: it names another model than
    the session's main calls (a title or summary request to a small model), or offers no tools where
    the main loop does. It must not become the chain tip, or the next main call would not extend it."""
    return bool(main.model and req.model and req.model != main.model) or (bool(main.tools) and not req.tools)


def _as_recorded(parsed: ParsedOutput, record: CallRecorded) -> ParsedOutput:
    """``parsed`` with the recorded (scrubbed) text and tool-call arguments; ids and names unchanged."""
    out = record.output
    calls = [dataclasses.replace(tc, arguments=rec.arguments) for tc, rec in zip(parsed.tool_calls, out.tool_calls)]
    return dataclasses.replace(parsed, text=out.text, reasoning=out.reasoning, tool_calls=calls)


def _advance_failed(st: SessionState, call_index: int) -> None:
    """The session after a recorded failed call: only the index and the count move (``failed`` is
    counted by ``Gateway.call``); the chain tip and the delta base stay on the last answered call."""
    st.next_call_index = call_index + 1
    st.calls += 1


def _advance(st: SessionState, key: tuple, req: ChatRequest, plan: PromptPlan, gen: Generation, parsed: ParsedOutput,
             call_index: int) -> None:
    """The session after a recorded call: next index, counters, and (main calls) the chain tip."""
    st.next_call_index = call_index + 1
    st.calls += 1
    full = [*plan.prompt_ids, *gen.completion_ids]
    st.last_call = (call_index, full)
    if req.side_call:
        st.side_calls += 1
        return
    st.evicted = False
    if plan.extends_call_index is not None and plan.break_reason != "retry":
        st.merged += 1
    elif plan.break_reason not in ("first_call", "retry"):
        st.breaks += 1
    st.remember(key, Turn(call_index, list(plan.prompt_ids), list(gen.completion_ids), list(req.messages),
                          list(req.tools), parsed.text, list(parsed.tool_calls), plan.extends_call_index,
                          plan.break_reason, req.model))
