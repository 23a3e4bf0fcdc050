"""LoRA runs through the gateway: each call goes to its run's current adapter whatever ``model`` the
client sends, and is recorded (in its run's topics) with that adapter's name and version; two runs share
one engine and one gateway (run B's session fanned out by its own rollout server, whose keys name the run);
a run stamped without an adapter stays on the base model."""

import httpx
import openai
import pytest

from infra.storage import join, write_bytes
from infra.topics import ensure_topics
from schemas import SessionAssigned, decode
from tests.plugins.gateway import CallsReader
from tests.plugins.infra import drop_topics
from tests.plugins.lora import lora_logprobs
from tests.plugins.rollout import start_rollout_server
from tests.streams.helpers import read_topic


def stamp(gw, version: int, lora_name: str = "", run: str = "") -> dict:
    r = httpx.post(gw.url + "/admin/policy_version", json={"version": version, "lora_name": lora_name, "run": run},
                   headers={"authorization": f"Bearer {gw.settings.admin_token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def call(gw, session_id: str, model: str, key: str = "", **claims) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key or gw.key(session_id, group_id="g", **claims))
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Create hello.txt"}],
                                   max_tokens=6, temperature=1.0)


def check_logprobs(record, model) -> None:
    want = lora_logprobs(model, list(record.prompt_ids), list(record.completion_ids))
    got = record.completion_logprobs
    assert len(got) == len(want) > 0
    assert max(abs(g - w) for g, w in zip(got, want.tolist())) <= 1e-5


def rollout_session_key(settings) -> str:
    """The key of the one session a rollout server for ``settings``' run fans a task out to."""
    srv = start_rollout_server(settings)
    try:
        r = httpx.post(srv.url + "/tasks", json={"task_id": "tb", "instruction": "do", "num_samples": 1, "min_valid": 1})
        assert r.status_code == 202, r.text
    finally:
        srv.stop()
    (msg,) = read_topic(settings, "sessions", until=lambda ms: len(ms) >= 1, timeout=30)
    return decode(msg.value, SessionAssigned).session_key


@pytest.fixture
def run_b(polar_settings):
    settings = polar_settings.model_copy(update={"topic_prefix": polar_settings.topic_prefix.rstrip(".") + "b."})
    ensure_topics(settings)
    yield settings
    drop_topics(settings)


def test_runs_route_to_their_own_adapter(polar_settings, run_b, engine_server_factory, gateway_factory, peft_adapters):
    engine = engine_server_factory(settings=polar_settings)
    s3_b = join(polar_settings.storage_url, "lora", "b")  # adapter b from S3, as a trainer would store it
    for f in peft_adapters["b"][0].iterdir():
        write_bytes(join(s3_b, f.name), f.read_bytes(), polar_settings)
    for name, path in (("a-v3", str(peft_adapters["a"][0])), ("b-v7", s3_b)):
        r = httpx.post(engine.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 200, r.text
    gw = gateway_factory(polar_settings, engine.url)
    assert stamp(gw, 3, "a-v3")["lora_name"] == "a-v3"
    assert stamp(gw, 7, "b-v7", run=run_b.topic_prefix) == {"version": 7, "lora_name": "b-v7", "run": run_b.topic_prefix,
                                                            "adapter_in_flight": 0}
    # run A (the gateway's own, its prefix named as a rollout server of this run names it): whatever the
    # client names, adapter a-v3 serves
    call(gw, "sa", "gpt-4o", run=polar_settings.topic_prefix)
    # run B, session tb.s0 from run B's rollout server: the base's name does not pick the base either
    call(gw, "tb.s0", "tiny", key=rollout_session_key(run_b))
    stamp(gw, 4)  # run A back on full weights: the base model, as before LoRA
    call(gw, "sa2", "gpt-4o")

    reader_a, reader_b = CallsReader(polar_settings), CallsReader(run_b)
    try:
        in_a, in_b = reader_a.wait(2), reader_b.wait(1)
    finally:
        reader_a.close()
        reader_b.close()
    by_session = {r.session_id: r for r in in_a}
    assert set(by_session) == {"sa", "sa2"} and [r.session_id for r in in_b] == ["tb.s0"]  # each run's own topics
    sa, sa2, (sb,) = by_session["sa"], by_session["sa2"], in_b
    assert (sa.served_model, sa.policy_version, sa.model) == ("a-v3", 3, "gpt-4o")
    assert (sb.served_model, sb.policy_version) == ("b-v7", 7)
    assert (sa2.served_model, sa2.policy_version) == ("tiny", 0)  # full weights: the engine's own version wins
    check_logprobs(sa, peft_adapters["a"][1])
    check_logprobs(sb, peft_adapters["b"][1])
    check_logprobs(sa2, peft_adapters[None][1])
    assert gw.gw.adapters_in_flight == {}


def test_unloaded_adapter_fails_the_call_and_is_recorded(polar_settings, engine_server_factory, gateway_factory):
    """A stamp naming an adapter the engine lacks: the harness gets the engine's 404 as an error, and the
    failed call is recorded with the stamp (never trained on: ``error`` set)."""
    engine = engine_server_factory()
    gw = gateway_factory(polar_settings, engine.url)
    stamp(gw, 2, "gone-v2")
    with pytest.raises(openai.APIStatusError):
        call(gw, "sx", "m")
    reader = CallsReader(polar_settings)
    try:
        (rec,) = reader.wait(1)
    finally:
        reader.close()
    assert rec.error and "does not exist" in rec.error and (rec.served_model, rec.policy_version) == ("gone-v2", 2)
