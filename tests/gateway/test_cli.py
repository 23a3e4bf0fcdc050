"""``polarstream gateway`` / ``gateway-key`` argument handling (the server itself is covered end to end)."""

from typer.testing import CliRunner

from gateway.sessions import verify_session_key
from infra.settings import Settings
from polarstream.cli import app


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
