"""The driver's children (polarstream/driver/processes.py): a killed driver's components are adopted by the next
one, and a component that dies mid-run is started again with its command, a bounded number of times."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from polarstream.driver.processes import Adopted, Processes, ProcessFailed

SLEEPER = (sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))")


def _procs(tmp_path, registry=True) -> Processes:
    return Processes(tmp_path / "logs", {}, registry=tmp_path / "components.json" if registry else None, program=SLEEPER)


def test_a_restarted_driver_adopts_the_children_still_running_and_keeps_their_ports(tmp_path):
    first = _procs(tmp_path)
    port = first.port("engine")
    child = first.start("engine", "60")
    recorded = json.loads((tmp_path / "components.json").read_text())
    assert recorded["children"]["engine"] == {"pid": child.proc.pid, "args": ["60"]} and recorded["ports"]["engine"] == port
    # the driver is gone without stopping anything (as after SIGKILL): the next one adopts the child
    second = _procs(tmp_path)
    assert second.port("engine") == port
    again = second.start("engine", "60")
    assert isinstance(again.proc, Adopted) and again.proc.pid == child.proc.pid and second.adopted == ["engine"]
    # a different command for the same name is not adopted: a new child starts
    other = second.start("trainer", "61")
    assert not isinstance(other.proc, Adopted)
    second.check_all()
    second.stop_all(grace=2)
    assert child.proc.wait(timeout=5) is not None and not (tmp_path / "components.json").exists()


def test_a_dead_child_is_not_adopted(tmp_path):
    first = _procs(tmp_path)
    child = first.start("engine", "60")
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    second = _procs(tmp_path)
    fresh = second.start("engine", "60")
    assert not isinstance(fresh.proc, Adopted) and fresh.proc.pid != child.proc.pid
    second.stop_all(grace=2)


def test_a_restartable_child_is_started_again_at_most_max_restarts_times(tmp_path):
    procs = _procs(tmp_path, registry=False)
    trainer = procs.start("trainer", "60")
    for n in range(2):
        os.kill(trainer.proc.pid, signal.SIGKILL)
        trainer.proc.wait()
        assert procs.check_all(restart=frozenset({"trainer"}), max_restarts=2) == ["trainer"]
        assert trainer.proc.poll() is None and trainer.restarts == n + 1
    os.kill(trainer.proc.pid, signal.SIGKILL)
    trainer.proc.wait()
    with pytest.raises(ProcessFailed, match="trainer exited"):
        procs.check_all(restart=frozenset({"trainer"}), max_restarts=2)
    procs.stop_all(grace=2)


def test_an_adopted_child_that_finished_counts_as_finished(tmp_path):
    first = _procs(tmp_path)
    done = first.start("trainer", "0.1")
    done.proc.wait()
    done_pid = done.proc.pid
    # an adopted child exits after adoption: its code is unknown, which finished_ok accepts
    live = first.start("engine", "60")
    second = _procs(tmp_path)
    adopted = second.start("engine", "60")
    assert isinstance(adopted.proc, Adopted) and adopted.proc.pid == live.proc.pid != done_pid
    os.kill(live.proc.pid, signal.SIGTERM)
    live.proc.wait()
    assert second.check_all(finished_ok=frozenset({"engine"})) == []
    with pytest.raises(ProcessFailed, match="engine exited with code -1"):
        second.check_all()
    second.stop_all(grace=2)


def test_a_running_child_with_another_command_is_stopped_before_its_successor_starts(tmp_path):
    first = _procs(tmp_path)
    first.start("ui", "60")
    old = first.start("engine", "60")
    second = _procs(tmp_path)
    second.start("ui", "60")  # recorded again: the engine's record must survive it
    new = second.start("engine", "61")
    assert old.proc.wait(timeout=15) is not None and new.proc.poll() is None and second.adopted == ["ui"]
    second.stop_all(grace=2)
