"""``forget --gateway``: a forgotten session is closed on the gateway, so its key records nothing more."""

import httpx
import pytest

from polarstream.tools.forget import close_sessions

pytestmark = pytest.mark.integration


def _call(gw, key):
    return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def test_forgotten_sessions_are_closed_on_the_gateway(polar_settings, scripted_engine, gateway_factory, dead_port):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("to-forget")
    assert _call(gw, key).status_code == 200
    assert close_sessions([gw.url], polar_settings.admin_token, {"to-forget", "never-called"}) == 2
    late = _call(gw, key)
    assert late.status_code == 401 and "closed" in late.json()["error"]["message"]
    assert _call(gw, gw.key("other")).status_code == 200  # only the forgotten sessions
    with pytest.raises(RuntimeError, match="refused to close session"):
        close_sessions([gw.url], "wrong-token", {"x"})
    with pytest.raises(RuntimeError, match="unreachable"):
        close_sessions([f"http://127.0.0.1:{dead_port}"], polar_settings.admin_token, {"x"})
