"""On-policy distillation: the teacher's per-token scores from a real engine become the trainer's advantages."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from producers.consumer import RecordConsumer
from schemas import Trace, TrainingGroup, Trajectory
from tests.plugins.trainer import publish_groups
from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.distill import Teacher, TeacherError, distill, teacher_logprobs, sequence_of
from trainer.metrics import read_log
from trainer.packing import sample_from_trace
from trainer.train import train

PROMPT, ROLLOUT_LP = [5, 17, 99, 3], -1.0  # ROLLOUT_LP: a recorded logprob where its value does not matter


def _reference_logprobs(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_distill_makes_each_token_advantage_the_weighted_teacher_minus_student_gap():
    s = sample_from_trace([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -2.0, -0.5], advantage=0.5, max_len=0)
    (got,) = distill([s], [[-1.0, -1.5]], distill_weight=2.0, reward_weight=0.0)
    assert got.advantages == (2.0 * (-1.0 + 2.0), 2.0 * (-1.5 + 0.5))  # teacher likes token 1 more, token 2 less
    (mixed,) = distill([s], [[-1.0, -1.5]], distill_weight=1.0, reward_weight=1.0)
    assert mixed.advantages == (0.5 + 1.0, 0.5 - 1.0)
    assert s.advantages == (0.5, 0.5)  # without a teacher: the trajectory's advantage on every token


def test_the_teacher_scores_given_tokens_through_a_real_engine(engine_server, tiny_model_dir):
    ids = PROMPT + [42, 7, 7]
    teacher = Teacher(engine_server.url)
    (scores,) = teacher.score([ids])
    want = _reference_logprobs(tiny_model_dir, ids)
    assert scores[0] is None and scores[1:] == pytest.approx(want, abs=1e-4)
    s = sample_from_trace(ids, [0] * 4 + [1] * 3, [0.0] * 4 + [ROLLOUT_LP] * 3, 0.0, 0)
    assert sequence_of(s) == ids and teacher_logprobs(s, scores) == pytest.approx(want[3:], abs=1e-4)
    with pytest.raises(TeacherError, match="HTTP 404"):  # a model the engine does not serve: one clear line
        Teacher(engine_server.url, model="nope").score([ids])
    teacher.close()


def _group(gid, completions, reward, rollout):
    """``rollout[i]``: the sampled tokens' logprobs of completion i (the student's, as the gateway records them)."""
    trajs = []
    for i, comp in enumerate(completions):
        trace = Trace(call_indices=[0], token_ids=PROMPT + comp, loss_mask=[0] * 4 + [1] * len(comp),
                      logprobs=[0.0] * 4 + rollout[i], policy_versions=[0])
        trajs.append(Trajectory(session_id=f"{gid}-{i}", group_id=gid, sample_index=i, reward=reward, traces=[trace],
                                num_samples=len(completions)))
    return TrainingGroup(group_id=gid, trajectories=trajs, advantages=[0.0] * len(trajs), reward_mean=reward,
                         policy_versions=[0] * len(trajs), zero_variance=True)


def test_trainer_learns_from_the_teacher_without_a_reward_and_records_its_scores(
        polar_settings, engine_server, tiny_model_dir, tmp_path):
    # every group's rewards tie (no task signal at all): only the teacher moves the weights
    # The teacher is the tiny model itself; the student sampled each token with the teacher's logprob - 0.1 on
    # the first completion (teacher likes them more: A = +0.1) and + 0.1 on the second (A = -0.1). Inside PPO's
    # clip either way, so the step moves the weights by the teacher's signal alone.
    comps = [[42, 7], [9, 11, 13]]
    ref = [_reference_logprobs(tiny_model_dir, PROMPT + c)[3:] for c in comps]
    rollout = [[q - 0.1 for q in ref[0]], [q + 0.1 for q in ref[1]]]
    groups = [_group(f"d{i}", comps, 1.0, rollout) for i in range(2)]
    publish_groups(polar_settings, groups, 0)
    cfg = TrainConfig.from_overrides({
        "model": str(tiny_model_dir), "groups_per_step": 1, "token_budget": 256, "lr": 1e-4, "idle_timeout_s": 3.0,
        "poll_timeout_s": 0.2, "run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False,
        "sync_every": 0, "distill_url": engine_server.url, "reward_weight": 0.0})
    summary = train(cfg, polar_settings)
    assert summary["step"] == 2 and "zero_variance" not in summary["counters"]

    steps = [r for r in read_log(tmp_path / "run" / "train.jsonl") if r["event"] == "step"]
    assert all(s["metrics"]["updated"] == 1.0 for s in steps)  # a tied group trained: the teacher's signal
    # the teacher's scores on record, one per trace, equal to the teacher model's own logprobs
    consumer = RecordConsumer(polar_settings, topics=["teacher"])
    got = []
    for _ in range(20):
        got += [r.record for r in consumer.poll(1.0)]
        if len(got) >= 4:
            break
    consumer.close()
    assert len(got) == 4 and {r.step for r in got} == {1, 2}
    for r in got:
        k = 0 if len(r.positions) == 2 else 1
        assert r.positions == list(range(4, 4 + len(comps[k])))
        # the first step scores with the teacher's weights; so does the second (the teacher is a separate engine)
        assert r.logprobs == pytest.approx(ref[k], abs=1e-3)
    # the reverse KL estimate: mean of student - teacher over the step's 5 tokens: (2 x -0.1 + 3 x 0.1) / 5
    assert steps[0]["metrics"]["distill_reverse_kl"] == pytest.approx(0.02, abs=1e-3)
    # and the student moved towards the teacher: the tokens it under-rated are likelier, the over-rated less likely
    local = checkpoint.download(checkpoint.latest(polar_settings.checkpoint_url, polar_settings).url, tmp_path / "ck",
                                polar_settings)
    after = [_reference_logprobs(local, PROMPT + c)[3:] for c in comps]
    assert sum(after[0]) > sum(ref[0]) and sum(after[1]) < sum(ref[1])


def test_sigkill_mid_distillation_then_restart_trains_each_group_once(polar_settings, engine_server, tiny_model_dir,
                                                                      tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from collections import Counter
    from pathlib import Path

    from tests.plugins.trainer import settings_env
    from trainer.metrics import effective_steps

    comps = [[42, 7], [9, 11, 13]]
    ref = [_reference_logprobs(tiny_model_dir, PROMPT + c)[3:] for c in comps]
    rollout = [[q - 0.1 for q in ref[0]], [q + 0.1 for q in ref[1]]]
    groups = [_group(f"k{i}", comps, 1.0, rollout) for i in range(8)]
    publish_groups(polar_settings, groups, 0)
    env = {**os.environ, **settings_env(polar_settings)}
    run_dir, log_path = tmp_path / "run", tmp_path / "run" / "train.jsonl"
    cmd = [str(Path(sys.executable).with_name("polarstream")), "train", "--model", str(tiny_model_dir),
           "--groups-per-step", "1", "--idle-timeout", "2", "--sync-every", "0", "--run-dir", str(run_dir),
           "--lr", "1e-4", "--token-budget", "256", "--set", "poll_timeout_s=0.2", "--set", "progress=false",
           "--set", "tensorboard=false", "--set", f"distill_url={engine_server.url}", "--set", "reward_weight=0",
           "--set", "max_staleness=1000"]  # all sampled by version 0

    def start(name):
        with open(tmp_path / name, "w") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def steps():
        return sum(1 for r in read_log(log_path) if r.get("event") == "step") if log_path.exists() else 0

    first = start("first.out")
    deadline = time.monotonic() + 180
    while steps() < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "first.out").read_text()  # the kill lands mid-run
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    second = start("second.out")
    assert second.wait(300) == 0, (tmp_path / "second.out").read_text()

    records = read_log(log_path)
    trained = Counter(g for s in effective_steps(records) for g in s["groups"])
    assert trained == Counter(g.event_id for g in groups)  # each group once, none missing, tied rewards and all
    assert all("distill_reverse_kl" in s["metrics"] for s in effective_steps(records))
    assert [r["step"] > 0 for r in records if r.get("event") == "start"] == [False, True]


def test_a_merged_multi_turn_trace_is_scored_whole_each_call_in_its_context():
    # two calls of a chain: prompt, call 0's tokens, a tool result (context), call 1's tokens
    ids = [1, 2, 3, 10, 11, 4, 5, 20, 21, 22]
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    s = sample_from_trace(ids, mask, [0.0 if not m else -0.5 for m in mask], 0.0, 0)
    assert sequence_of(s) == ids  # one prompt for the teacher: the whole chain, tool result included
    scores = [None] + [-float(i) for i in range(1, len(ids))]  # the teacher's logprob of token i given ids[:i]
    assert teacher_logprobs(s, scores) == [-3.0, -4.0, -7.0, -8.0, -9.0]  # every sampled token, in context
