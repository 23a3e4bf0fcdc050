"""Trainer fixtures: a tiny causal LM directory and synthetic training groups."""

from __future__ import annotations

import pytest

from schemas import Trace, TrainingGroup, Trajectory


def build_tiny_model(out_dir, seed: int = 0, vocab_size: int = 256):
    """A ~100k-parameter Qwen3-style model saved in HF layout (config.json + model.safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.save_pretrained(out_dir)
    (out_dir / "tokenizer_config.json").write_text('{"model_max_length": 1024}\n')  # stands in for tokenizer files
    return out_dir


@pytest.fixture(scope="session")
def trainer_model_dir(tmp_path_factory):
    """A ~100k-parameter model: checkpoints of a few hundred kB keep the Kafka/S3 tests fast.
    Tests that serve the model from our engine use the engine's ``tiny_model_dir`` instead."""
    return build_tiny_model(tmp_path_factory.mktemp("trainer-model"))


def make_group(group_id: str, completions: list[list[int]], rewards: list[float], prompt: list[int] | None = None,
               policy_version: int = 0, logprob: float = -1.0) -> TrainingGroup:
    """A group of one-trace trajectories: ``prompt`` (mask 0) + each completion (mask 1)."""
    prompt = prompt or [1, 2, 3, 4]
    mean = sum(rewards) / len(rewards)
    trajs = []
    for i, (comp, r) in enumerate(zip(completions, rewards)):
        ids = prompt + comp
        trace = Trace(call_indices=[0], token_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(comp),
                      logprobs=[0.0] * len(prompt) + [logprob] * len(comp), policy_versions=[policy_version])
        trajs.append(Trajectory(session_id=f"{group_id}-s{i}", group_id=group_id, sample_index=i, reward=r,
                                traces=[trace], num_samples=len(completions)))
    return TrainingGroup(group_id=group_id, trajectories=trajs, advantages=[r - mean for r in rewards],
                         reward_mean=mean, policy_versions=[policy_version] * len(completions),
                         std_normalized=False, zero_variance=all(r == mean for r in rewards))


def settings_env(settings) -> dict[str, str]:
    """POLAR_* environment variables that rebuild ``settings`` in a subprocess."""
    import json

    env = {}
    for key, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        env[f"POLAR_{key.upper()}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return env


def end_offsets(settings, logical_topic: str = "groups") -> dict[int, int]:
    """Partition -> high watermark of a topic (the next offset that would be written)."""
    from confluent_kafka import Consumer, TopicPartition

    topic = settings.topic(logical_topic)
    c = Consumer(settings.kafka_config(**{"group.id": "trainer-test-watermarks"}))
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def publish_groups(settings, groups, partition: int | None = None) -> None:
    """Publish TrainingGroups durably (acknowledged by the broker) in order.

    ``partition``: all to that partition (whatever their group ids), so a reader sees them in this order.
    """
    from producers.publisher import Publisher

    if partition is None:
        with Publisher(settings) as pub:
            for g in groups:
                pub.publish_sync(g, timeout=30)
        return
    from confluent_kafka import Producer

    from schemas import encode

    producer = Producer(settings.kafka_config(**{"acks": "all"}))
    for g in groups:
        producer.produce(settings.topic("groups"), encode(g, packed=settings.packed),
                         key=g.key().encode(), partition=partition)
    assert producer.flush(30) == 0


def read_policy(settings, n: int, polls: int = 20, synced: bool = False) -> list:
    """The first ``n`` PolicyVersion records on polar.policy as the trainer published them once trained, or
    (``synced``) again once the engines served them, with their sync (fewer if they do not arrive in time)."""
    from producers.consumer import RecordConsumer

    consumer = RecordConsumer(settings, topics=["policy"])
    got = []
    try:
        for _ in range(polls):
            got += [r.record for r in consumer.poll(1.0) if bool(r.record.sync) == synced]
            if len(got) >= n:
                break
    finally:
        consumer.close()
    return got
