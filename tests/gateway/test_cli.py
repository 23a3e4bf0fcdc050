"""``polarstream gateway`` / ``gateway-key`` argument handling (the server itself is covered end to end)."""

from typer.testing import CliRunner

from infra.settings import Settings
from polarstream.cli import app
from schemas.session_keys import verify_session_key


def test_gateway_key_prints_a_verifiable_key():
    r = CliRunner().invoke(app, ["gateway-key", "sess-9", "--group-id", "g", "--sample-index", "3"])
    assert r.exit_code == 0, r.output
    claims = verify_session_key(r.output.strip(), Settings().session_secret)
    assert (claims.session_id, claims.group_id, claims.sample_index) == ("sess-9", "g", 3)


def test_gateway_rejects_unknown_upstream_and_publish_mode():
    base = ["gateway", "--engine-url", "http://127.0.0.1:1", "--model", "/nonexistent"]
    r = CliRunner().invoke(app, [*base, "--upstream", "tgi"])
    assert r.exit_code == 2 and "expected polar, vllm or sglang" in r.output
    r = CliRunner().invoke(app, [*base, "--publish-mode", "later"])
    assert r.exit_code == 2 and "expected sync or async" in r.output
    r = CliRunner().invoke(app, [*base, "--history", "rendered"])
    assert r.exit_code == 2 and "'rendered': expected sampled or template" in r.output


def test_gateway_refuses_a_public_address_with_development_credentials(monkeypatch):
    base = ["gateway", "--engine-url", "http://127.0.0.1:1", "--model", "/nonexistent", "--host", "0.0.0.0"]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 2 and "POLAR_ADMIN_TOKEN and POLAR_SESSION_SECRET" in r.output
    monkeypatch.setenv("POLAR_ADMIN_TOKEN", "a-real-token")
    monkeypatch.setenv("POLAR_SESSION_SECRET", "a-real-secret")
    r = CliRunner().invoke(app, [*base, "--open"])
    assert r.exit_code == 2 and "--allow-open-remote" in r.output


def test_exposure_rules():
    import pytest

    from gateway.exposure import UnsafeExposure, check_exposure
    from infra.reach import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.4.5.6")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.7") and not is_loopback("gw.internal")
    dev = {"admin_token": "polar-admin", "session_secret": "polar-dev-session-secret"}
    real = {"admin_token": "t0k", "session_secret": "s3c"}
    check_exposure("127.0.0.1", **dev, open_mode=True)  # loopback: anything goes
    with pytest.raises(UnsafeExposure, match="POLAR_SESSION_SECRET"):
        check_exposure("10.0.0.7", admin_token="t0k", session_secret="polar-dev-session-secret")
    with pytest.raises(UnsafeExposure, match="--allow-open-remote"):
        check_exposure("10.0.0.7", **real, open_mode=True)
    check_exposure("10.0.0.7", **real, open_mode=True, allow_open_remote=True)
    check_exposure("10.0.0.7", **real)



def test_gateway_refuses_an_unknown_parser_name_in_one_line_before_waiting_on_the_engine(monkeypatch):
    from infra.models import ensure_model

    monkeypatch.setenv("POLAR_WAIT_FOR_S", "0")
    base = ["gateway", "--engine-url", "http://127.0.0.1:1", "--model", str(ensure_model("tiny"))]
    r = CliRunner().invoke(app, [*base, "--tool-parser", "nope"])
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "unknown tool parser 'nope'; choose one of" in said and "hermes" in said, r.output
    r = CliRunner().invoke(app, [*base, "--reasoning-parser", "nope"])
    assert r.exit_code == 2 and "unknown reasoning parser 'nope'" in " ".join(r.output.replace("│", " ").split())
    r = CliRunner().invoke(app, [*base, "--tool-parser", "qwen3_coder"])  # a known one: on to the engine
    assert r.exit_code == 1 and "cannot reach the engine" in r.output, r.output
