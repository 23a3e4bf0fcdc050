"""gateway/gate.py: a pause holds calls, drains in-flight ones, and ends by itself at its deadline."""

import asyncio

import pytest

from gateway.gate import Gate, GateClosed


def test_a_pause_without_resume_ends_at_its_deadline(caplog):
    async def run():
        gate = Gate()
        assert await gate.pause(drain_timeout_s=1, deadline_s=0.2)
        assert gate.paused
        with pytest.raises(GateClosed):
            async with gate.enter(hold_timeout_s=0.05):
                pass
        async with gate.enter(hold_timeout_s=2):  # held until the deadline reopens the gate, then let through
            assert not gate.paused
        assert gate.auto_resumed == 1
        await gate.pause(drain_timeout_s=1, deadline_s=0.1)
        gate.resume()  # a resume in time cancels the deadline
        await gate.pause(drain_timeout_s=1, deadline_s=5)
        await asyncio.sleep(0.2)
        assert gate.paused and gate.auto_resumed == 1  # the earlier deadline did not reopen this pause

    asyncio.run(run())
    assert "resuming by itself" in caplog.text
