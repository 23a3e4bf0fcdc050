"""The gateway's per-session store: creation, shedding, closed sessions, restarts, tombstones."""

import pytest

from gateway.sessions import SessionClosed, SessionStore
from schemas.session_keys import SessionClaims, mint_session_key, verify_session_key

SECRET = "s3cret"


def test_store_creates_once_and_sheds_idle_sessions_but_keeps_their_call_index():
    store = SessionStore(max_sessions=2)
    first = store.get(SessionClaims("a"))
    assert store.get(SessionClaims("a")) is first
    first.next_call_index, first.main = 5, "tip"  # a session with history
    store.get(SessionClaims("b"))
    store.get(SessionClaims("c"))  # over capacity: "a" (least recent) is shed, not forgotten
    a = store.find("a")
    assert a is first and (a.main, a.evicted, a.next_call_index) == (None, True, 5)
    assert store.get(SessionClaims("a")) is first  # coming back continues its call indexes
    assert len(store) == 3
    assert store.drop("c") is not None and store.find("c") is None


def test_store_forgets_shed_sessions_beyond_ten_times_capacity():
    store = SessionStore(max_sessions=1)
    for i in range(15):
        store.get(SessionClaims(f"s{i}"))
    assert len(store) == 11 and store.find("s0") is None and store.find("s14") is not None
    with pytest.raises(SessionClosed):  # its call indexes are gone with it: refused, never restarted at 0
        store.get(SessionClaims("s0"))


def test_a_dropped_session_is_closed_until_its_key_expires():
    store = SessionStore()
    claims = verify_session_key(mint_session_key("s", SECRET), SECRET)
    store.get(claims).next_call_index = 3
    store.drop("s")
    with pytest.raises(SessionClosed, match="closed"):
        store.get(claims)  # an old key cannot start it again at call_index 0
    store.drop("never-seen")  # closing an unknown session (forget) works too
    assert store.closed("never-seen") and not store.closed("other")
    expired = SessionStore(tombstone_ttl_s=0.01)
    expired.drop("x")
    import time

    time.sleep(0.02)
    assert not expired.closed("x") and expired.get(SessionClaims("x"))  # the tombstone ends with the key's validity


def test_a_restarted_store_numbers_an_earlier_sessions_calls_above_its_predecessors(tmp_path):
    before = SessionStore(boot_at=1_790_000_000.0)
    old = verify_session_key(mint_session_key("old", SECRET, now=1_790_000_000.5), SECRET, now=1_790_000_001)
    st = before.get(old)
    assert st.next_call_index == 0  # minted while this process ran: a new session, numbered from 0
    st.next_call_index = 5_000  # calls recorded before the crash
    after = SessionStore(boot_at=1_790_000_003.0)  # a restart 2.5 s later: the state is gone
    assert after.get(old).next_call_index == after.boot_base > 5_000  # never a collision with indexes 0..4999
    assert after.boot_base - before.boot_base == 3_000 and after.boot_id != before.boot_id
    assert after.get(SessionClaims("open:adhoc")).next_call_index == after.boot_base  # no mint time: may be old
    new = verify_session_key(mint_session_key("new", SECRET, now=1_790_000_004.0), SECRET, now=1_790_000_005)
    assert after.get(new).next_call_index == 0


def test_closed_sessions_stay_closed_across_a_restart(tmp_path):
    from gateway.tombstones import TombstoneFile

    path = tmp_path / "gateway" / "tombstones.jsonl"
    claims = verify_session_key(mint_session_key("done", SECRET), SECRET)
    first = SessionStore(tombstones=TombstoneFile(path))
    first.get(claims)
    first.drop("done")
    first.drop("forgotten")
    restarted = SessionStore(tombstones=TombstoneFile(path))
    with pytest.raises(SessionClosed, match="closed"):
        restarted.get(claims)
    assert restarted.closed("forgotten") and not restarted.closed("other")
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_the_tombstone_file_forgets_expired_lines_and_skips_torn_ones(tmp_path):
    from gateway.tombstones import TombstoneFile

    f = TombstoneFile(tmp_path / "t.jsonl")
    for i in range(100):
        f.append(f"old{i}", 1_000.0)  # long expired
    f.append("live", 5_000.0)
    with open(f.path, "ab") as out:
        out.write(b'["torn", 50')  # a machine crash cut the last write short
    assert f.load(now=2_000.0) == {"live": 5_000.0}
    assert f.path.read_bytes() == b'["live",5000.0]\n'  # mostly expired: rewritten with only what is live
    f.append("next", 6_000.0)
    assert f.load(now=2_000.0) == {"live": 5_000.0, "next": 6_000.0}
