"""gateway/sampling.py: rollout sessions sample with the run's settings; others keep the harness's."""

import pytest

from gateway.canonical import Sampling
from gateway.sampling import SamplingPolicy
from schemas.session_keys import SessionClaims

ROLLOUT, ADHOC = SessionClaims("s", group_id="g"), SessionClaims("open:x")
GEMINI = Sampling(temperature=1.0, top_p=0.95, top_k=64)  # what Gemini CLI sends


def test_rollout_sessions_are_pinned_to_the_runs_settings():
    used = SamplingPolicy(temperature=0.8).effective(GEMINI, ROLLOUT)
    assert (used.temperature, used.top_p, used.top_k, used.pinned, used.matches_run) == (0.8, 1.0, 0, True, True)


def test_other_sessions_keep_the_harness_settings_and_say_whether_they_match():
    policy = SamplingPolicy()
    used = policy.effective(GEMINI, ADHOC)
    assert (used.temperature, used.top_p, used.top_k, used.pinned, used.matches_run) == (1.0, 0.95, 64, False, False)
    assert policy.effective(Sampling(), ADHOC).matches_run  # nothing asked: the run's defaults
    assert not SamplingPolicy(mode="pass").effective(GEMINI, ROLLOUT).pinned  # evaluation: keep the harness's
    greedy = policy.effective(Sampling(top_p=0), ADHOC)
    assert (greedy.top_p, greedy.top_k, greedy.matches_run) == (1.0, 1, False)


@pytest.mark.parametrize("bad", [{"mode": "maybe"}, {"temperature": 0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingPolicy(**bad)
