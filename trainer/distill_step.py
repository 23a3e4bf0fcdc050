"""rank 0's side of on-policy distillation in the trainer loop: ask the teacher about a step's samples, turn
its scores into per-token advantages (distill.py) and record them on polar.teacher."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from infra.settings import Settings
from producers.publisher import Publisher
from schemas import TeacherScores

from .config import TrainConfig
from .distill import Teacher, distill, reverse_kl, sequence_of, teacher_logprobs
from .packing import Sample


class StepTeacher:
    def __init__(self, cfg: TrainConfig, settings: Settings):
        self.cfg = cfg
        self.teacher = Teacher(cfg.distill_url, cfg.distill_model, cfg.distill_timeout_s)
        self.publisher = Publisher(settings, client_id="polar-trainer-teacher")

    def apply(self, samples: Sequence[Sample], step: int) -> tuple[list[Sample], float]:
        """(samples with the teacher's per-token advantages, the mean reverse KL of their tokens); the
        teacher's scores are published first (acknowledged), so what the step trained on is on record."""
        scores = self.teacher.score([sequence_of(s) for s in samples])
        lps = [teacher_logprobs(s, sc) for s, sc in zip(samples, scores)]
        trace_no: Counter[str] = Counter()
        for s, q in zip(samples, lps):
            group_event, _, traj = s.trajectory_id.partition("/")
            self.publisher.publish_sync(TeacherScores(
                group_id=s.group_id, group_event_id=group_event, trajectory_id=traj,
                trace_index=trace_no[s.trajectory_id], teacher=self.teacher.name, step=step,
                positions=[p + 1 for p in s.trained], logprobs=q, latency_ms=self.teacher.last_latency_ms), timeout=30)
            trace_no[s.trajectory_id] += 1
        return distill(samples, lps, self.cfg.distill_weight, self.cfg.reward_weight), reverse_kl(samples, lps)

    def close(self) -> None:
        self.teacher.close()
        self.publisher.close()
