"""On-policy distillation: a teacher engine scores the student's own sampled tokens; the per-token reverse KL
becomes the advantage.

For each trained token t of a trace, sampled by the student with logprob ``s_t`` (the rollout logprob the
gateway recorded), the teacher's logprob of the same token in the same context is ``q_t``. The per-token
reverse KL estimate is s_t - q_t, and the token's advantage is

    A_t = reward_weight * A_group + distill_weight * (q_t - s_t)

so with ``reward_weight`` 0 the run learns from the teacher alone, no reward needed (Agarwal et al. 2024,
GKD; Thinking Machines' "On-policy distillation", 2025). The loss is the trainer's (PPO-clip by default);
only the advantages change.

Where: the trainer asks the teacher, once per step, for the traces it is about to train. The scores must be
of exactly the tokens trained (after ``max_trace_tokens`` cuts), a group needs no extra stage and topic hop
between the group stage and the trainer, and the teacher is a read-only model like the KL reference: data
still flows one way (groups -> trainer -> weights), the teacher's answers out to polar.teacher as records of
what the signal was. Multi-turn: a prefix-merged trace is one sequence holding every call of a chain, so
scoring it whole scores each call's tokens in the context it was sampled in.

The teacher is any engine that answers vLLM's ``prompt_logprobs`` on /v1/completions: vLLM, or ours.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import httpx

from .packing import Sample


class TeacherError(RuntimeError):
    """The teacher did not answer, or answered something that is not a score of the tokens sent."""


class Teacher:
    def __init__(self, url: str, model: str = "", timeout_s: float = 300.0):
        self.url, self.model = url.rstrip("/"), model
        self._client = httpx.Client(timeout=timeout_s)
        self.last_latency_ms = 0.0

    @property
    def name(self) -> str:
        return f"{self.url}#{self.model}"

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """The teacher's logprob of each token of each sequence given the ones before it (None for the first)."""
        if not sequences:
            return []
        body = {"prompt": [list(s) for s in sequences], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        if self.model:
            body["model"] = self.model
        t0 = time.perf_counter()
        try:
            r = self._client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise TeacherError(f"teacher {self.url}: {type(e).__name__}: {e}") from None
        self.last_latency_ms = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            raise TeacherError(f"teacher {self.url}: HTTP {r.status_code}: {r.text[:300]}")
        choices = r.json().get("choices") or []
        if len(choices) != len(sequences):  # n=1: one choice per prompt, in prompt order
            raise TeacherError(f"teacher {self.url}: {len(choices)} choices for {len(sequences)} prompts")
        return [_token_logprobs(seq, c.get("prompt_logprobs"), self.url) for seq, c in zip(sequences, choices)]

    def close(self) -> None:
        self._client.close()


def _token_logprobs(seq: Sequence[int], scores: list | None, url: str) -> list[float | None]:
    if not isinstance(scores, list) or len(scores) != len(seq):
        raise TeacherError(f"teacher {url}: no prompt_logprobs for a {len(seq)}-token prompt (does it serve them?)")
    out: list[float | None] = [None]
    for tok, entry in zip(seq[1:], scores[1:]):
        try:
            out.append(float(entry[str(tok)]["logprob"]))
        except (KeyError, TypeError, ValueError):
            raise TeacherError(f"teacher {url}: prompt_logprobs without the prompt token {tok}") from None
    return out


def sequence_of(s: Sample) -> list[int]:
    """The token ids a sample was cut from: its inputs and its last target."""
    return [*s.input_ids, s.targets[-1]]


def teacher_logprobs(s: Sample, scores: list[float | None]) -> list[float]:
    """The teacher's logprob of each trained target of ``s`` (target p is token p + 1 of its sequence)."""
    return [float(scores[p + 1]) for p in s.trained]


def distill(samples: Sequence[Sample], teacher_lps: Sequence[Sequence[float]], distill_weight: float,
            reward_weight: float) -> list[Sample]:
    """Each sample with per-token advantages reward_weight * A + distill_weight * (q_t - s_t)."""
    out = []
    for s, q in zip(samples, teacher_lps, strict=True):
        # s.advantages: the group's advantage, or a judge's per-call scores where it gave them
        adv = tuple(reward_weight * a + distill_weight * (qt - st)
                    for a, qt, st in zip(s.advantages, q, s.rollout_logprobs, strict=True))
        out.append(replace(s, token_advantages=adv))
    return out


def reverse_kl(samples: Sequence[Sample], teacher_lps: Sequence[Sequence[float]]) -> float:
    """Mean per-token reverse KL estimate (student - teacher logprob on the sampled tokens): the distillation
    run's progress figure, falling as the student learns."""
    diffs = [st - qt for s, q in zip(samples, teacher_lps) for qt, st in zip(q, s.rollout_logprobs)]
    return sum(diffs) / len(diffs) if diffs else 0.0
