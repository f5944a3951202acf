"""``trainer.run.checkpoints.Checkpoints``: one background save in flight at most, committed by the
first step end after every rank wrote it (``written``) or before the next save; a blocking save commits the one in
flight first; the metrics each step record gets. The saves are stand-ins (the real ones:
``tests/mcore/test_async_checkpoint.py``; through ``empg train``: ``test_preemption.py``)."""

from __future__ import annotations

from pathlib import Path

from megatron_empg.trainer.run import checkpoints


class _Pending:
    def __init__(self, step: int, background: bool, log: list) -> None:
        self.step, self.in_background, self.log = step, background, log
        self.blocking_s, self.persist_s = 0.5, 2.0
        self.written = False

    def written_everywhere(self) -> bool:
        self.log.append(("poll", self.step))
        return self.written


def _checkpoints(monkeypatch, background: bool):
    log, started = [], []

    def start(staging):
        started.append(_Pending(len(started) + 1, staging is not None, log))
        return started[-1]

    def finish(pending):
        log.append(("commit", pending.step))
        return Path(f"step_{pending.step}")

    monkeypatch.setattr(checkpoints, "_finish", finish)
    return checkpoints.Checkpoints(start, background=background), log, started


def test_background_saves_commit_later_and_once(monkeypatch):
    c, log, started = _checkpoints(monkeypatch, background=True)
    assert c.save(blocking=False) is None and started[0].in_background
    assert c.metrics() == {"checkpoint/blocking_s": 0.5, "checkpoint/writing": 1.0}
    assert not c.written() and log == [("poll", 1)]  # not written yet everywhere
    started[0].written = True
    assert c.written() and c.finish() == Path("step_1") and log[-1] == ("commit", 1)
    assert c.metrics() == {"checkpoint/persist_s": 2.0, "checkpoint/writing": 0.0}
    assert not c.written() and log[-1] == ("commit", 1)  # nothing in flight: no collective either

    c.save(blocking=False)  # step 2 in flight, then a blocking save (the last step, a signal)
    assert c.save(blocking=True) == Path("step_3")
    assert log[-2:] == [("commit", 2), ("commit", 3)] and not started[2].in_background
    assert c.finish() is None


def test_a_save_commits_the_one_in_flight_first(monkeypatch):
    c, log, _ = _checkpoints(monkeypatch, background=True)
    c.save(blocking=False)
    c.save(blocking=False)
    assert log == [("commit", 1)]
    assert c.finish() == Path("step_2")


def test_without_background_every_save_commits_at_once(monkeypatch):
    c, log, started = _checkpoints(monkeypatch, background=False)
    assert c.save(blocking=False) == Path("step_1") and not started[0].in_background
    assert c.metrics() == {"checkpoint/blocking_s": 0.5}
    assert log == [("commit", 1)]


def test_null_means_in_the_background_on_a_gpu(monkeypatch):
    monkeypatch.setattr(checkpoints.torch.cuda, "is_available", lambda: True)
    assert checkpoints.async_saves(None) and not checkpoints.async_saves(False)
    monkeypatch.setattr(checkpoints.torch.cuda, "is_available", lambda: False)
    assert not checkpoints.async_saves(None) and checkpoints.async_saves(True)
