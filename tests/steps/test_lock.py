"""Step locks: exclusive, heartbeated, taken over only when the holder is gone."""

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from keel.core.errors import LockLostError
from keel.steps.lock import LockSettings, StepLock

FAST = LockSettings(heartbeat_every=0.05, stale_after=1.0, poll_every=0.01)


def _write_lock(path, *, host, pid, heartbeat):
    path.write_text(
        json.dumps(
            {
                "owner": "someone",
                "host": host,
                "pid": pid,
                "pid_start": None,
                "heartbeat": heartbeat,
            }
        )
    )


def test_lock_is_exclusive_until_released(tmp_path):
    first, second = (
        StepLock(str(tmp_path / "lock.json"), FAST),
        StepLock(str(tmp_path / "lock.json"), FAST),
    )
    assert first.try_acquire()
    assert not second.try_acquire()
    first.release()
    assert not (tmp_path / "lock.json").exists()
    assert second.try_acquire()
    second.release()


def test_heartbeat_keeps_the_lock_fresh(tmp_path):
    lock = StepLock(str(tmp_path / "lock.json"), FAST)
    assert lock.try_acquire()
    first_beat = lock.holder().heartbeat
    time.sleep(0.3)
    assert lock.holder().heartbeat > first_beat
    lock.check_held()
    lock.release()


def test_lock_of_another_host_is_taken_over_only_after_its_heartbeat_goes_stale(tmp_path):
    path = tmp_path / "lock.json"
    _write_lock(path, host="elsewhere", pid=1, heartbeat=time.time())
    assert not StepLock(str(path), FAST).try_acquire()
    _write_lock(path, host="elsewhere", pid=1, heartbeat=time.time() - 5)
    taker = StepLock(str(path), FAST)
    assert taker.try_acquire()
    assert taker.holder().owner == taker.owner
    taker.release()


def test_lock_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp_path / "lock.json"
    _write_lock(path, host=socket.gethostname(), pid=int(finished.stdout), heartbeat=time.time())
    taker = StepLock(str(path), LockSettings(stale_after=3600))
    assert taker.try_acquire()
    taker.release()


def test_of_many_runners_that_see_the_same_stale_lock_exactly_one_takes_it(tmp_path):
    path = tmp_path / "lock.json"
    _write_lock(path, host="elsewhere", pid=1, heartbeat=0.0)
    contenders = [StepLock(str(path), FAST) for _ in range(8)]
    start = threading.Barrier(len(contenders))
    won = []

    def contend(lock):
        start.wait()
        if lock.try_acquire():
            won.append(lock)

    threads = [threading.Thread(target=contend, args=(lock,)) for lock in contenders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    assert json.loads(path.read_text())["owner"] == won[0].owner
    won[0].release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no takeover tokens left behind


def test_a_holder_whose_lock_was_taken_over_knows_it(tmp_path):
    path = tmp_path / "lock.json"
    lock = StepLock(str(path), FAST)
    assert lock.try_acquire()
    _write_lock(path, host="elsewhere", pid=1, heartbeat=time.time())
    with pytest.raises(LockLostError, match="taken over"):
        lock.check_held()
    lock.release()
    assert path.exists()  # the new holder's lock is left alone
