"""Session keys (schemas/session_keys.py): mint, verify, forgery, expiry, open mode."""

import pytest

from schemas.session_keys import (
    InvalidSessionKey,
    SessionClaims,
    mint_session_key,
    open_session_claims,
    verify_session_key,
)

SECRET = "s3cret"


def test_key_round_trips_its_claims():
    key = mint_session_key("sess-1", SECRET, group_id="g", task_id="t", sample_index=3, attempt=1, harness="codex")
    assert key.startswith("sk-polar-")
    assert verify_session_key(key, SECRET) == SessionClaims("sess-1", "g", "t", 3, 1, "codex")


def test_key_with_defaults_is_short_and_header_safe():
    key = mint_session_key("s", SECRET)
    assert len(key) < 96 and all(c.isalnum() or c in "-_." for c in key)  # expiry and mint time included
    assert verify_session_key(key, SECRET) == SessionClaims("s")


def test_wrong_secret_is_rejected():
    with pytest.raises(InvalidSessionKey, match="signature"):
        verify_session_key(mint_session_key("s", SECRET), "other")


def test_claims_cannot_be_swapped_between_keys():
    a, b = mint_session_key("a", SECRET), mint_session_key("b", SECRET)
    forged = a.split(".")[0] + "." + b.split(".")[1]  # a's claims with b's signature
    with pytest.raises(InvalidSessionKey):
        verify_session_key(forged, SECRET)


@pytest.mark.parametrize("key", ["", "sk-ant-xyz", "sk-polar-", "sk-polar-abc", "sk-polar-.sig", "sk-polar-e30.x"])
def test_malformed_keys_are_rejected(key):
    with pytest.raises(InvalidSessionKey):
        verify_session_key(key, SECRET)


def test_mint_refuses_empty_session():
    with pytest.raises(ValueError, match="session_id"):
        mint_session_key("", SECRET)


def test_open_mode_maps_each_key_to_its_own_stable_session():
    assert open_session_claims("k1") == open_session_claims("k1")
    assert open_session_claims("k1").session_id != open_session_claims("k2").session_id
    assert "k1" not in open_session_claims("k1").session_id  # the key itself is not leaked into events


def test_keys_expire_and_a_key_without_expiry_is_refused():
    import orjson

    from schemas.session_keys import KEY_PREFIX, _b64, _sign

    key = mint_session_key("s", SECRET, ttl_s=60, now=1_000_000)
    assert verify_session_key(key, SECRET, now=1_000_059).session_id == "s"
    with pytest.raises(InvalidSessionKey, match="expired at 1970-01-12T13:47:40Z"):
        verify_session_key(key, SECRET, now=1_000_060)
    payload = _b64(orjson.dumps({"s": "s"}))  # signed, but minted before keys carried an expiry
    with pytest.raises(InvalidSessionKey, match="no expiry"):
        verify_session_key(f"{KEY_PREFIX}{payload}.{_sign(payload, SECRET)}", SECRET)


def test_open_sessions_live_in_their_own_namespace():
    assert open_session_claims(name="my-run").session_id == "open:my-run"
    assert open_session_claims(name="a/b c").session_id.startswith("open:") and "a/b" not in open_session_claims(name="a/b c").session_id
    assert open_session_claims("k1").session_id.startswith("open:")
    with pytest.raises(ValueError, match="namespace"):
        mint_session_key("open:my-run", SECRET)  # a minted key can never name an ad-hoc session
