"""keel.core.gang: N real processes as one gang, with the environment a launcher gives them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keel.core.errors import UsageError
from keel.core.gang import free_port, run_local_gang
from keel.core.process import process_alive


def _member(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_every_member_gets_its_index_the_size_and_one_coordinator(tmp_path):
    member = _member(
        f"""
        import json, os
        keys = ("KEEL_COORDINATOR", "KEEL_REPLICA", "KEEL_REPLICAS", "FROM_CALLER")
        seen = {{k: os.environ.get(k) for k in keys}}
        with open(os.path.join({str(tmp_path)!r}, seen["KEEL_REPLICA"]), "w") as out:
            json.dump(seen, out)
        """
    )
    assert run_local_gang(member, 3, env={**os.environ, "FROM_CALLER": "yes"}) == 0
    seen = [json.loads((tmp_path / str(i)).read_text()) for i in range(3)]
    assert [s["KEEL_REPLICA"] for s in seen] == ["0", "1", "2"]
    assert {s["KEEL_REPLICAS"] for s in seen} == {"3"}
    assert {s["FROM_CALLER"] for s in seen} == {"yes"}
    coordinators = {s["KEEL_COORDINATOR"] for s in seen}
    assert len(coordinators) == 1
    host, port = coordinators.pop().rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_a_failing_member_stops_the_others_and_its_code_is_returned(tmp_path):
    member = _member(
        f"""
        import os, sys, time
        replica = os.environ["KEEL_REPLICA"]
        open(os.path.join({str(tmp_path)!r}, "pid-" + replica), "w").write(str(os.getpid()))
        if replica == "1":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(120)
        """
    )
    started = time.monotonic()
    assert run_local_gang(member, 3) == 3
    assert time.monotonic() - started < 30
    for replica in (0, 2):
        assert not process_alive(int((tmp_path / f"pid-{replica}").read_text()))


def test_a_member_killed_by_a_signal_fails_the_gang_as_a_shell_would_say():
    member = _member(
        """
        import os, signal, time
        if os.environ["KEEL_REPLICA"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
        """
    )
    assert run_local_gang(member, 2) == 128 + signal.SIGKILL


def test_output_of_process_0_passes_through_and_the_others_are_prefixed(capfd):
    member = _member(
        """
        import os, sys
        print("hello from", os.environ["KEEL_REPLICA"], flush=True)
        print("warning from", os.environ["KEEL_REPLICA"], file=sys.stderr, flush=True)
        """
    )
    assert run_local_gang(member, 2) == 0
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[process 1] hello from 1", "hello from 0"]
    assert sorted(err.splitlines()) == ["[process 1] warning from 1", "warning from 0"]


def test_gloo_notes_that_ranks_connected_are_left_out_even_when_interleaved(capfd):
    """gloo's threads write "[Gloo] Rank i is connected to n peer ranks..." into each other's
    lines, a dozen per program; a member's other output, on the same line too, stays, and so
    does a note of fewer peers than expected."""
    note = "[Gloo] Rank {} is connected to {} peer ranks. "
    note += "Expected number of connected peer ranks is : 3"
    short = note.format(2, 1)
    member = _member(
        f"""
        import sys
        sys.stderr.write({note.format(0, 3)!r} + {note.format(1, 3)!r} + "\\n")
        sys.stderr.write({short!r} + "\\n")
        sys.stderr.write({note.format(2, 3)!r} + "step 1\\n")
        """
    )
    assert run_local_gang(member, 1) == 0
    _, err = capfd.readouterr()
    assert err.splitlines() == [short, "step 1"]


@pytest.mark.parametrize(
    ("number", "to_group", "says"),
    [
        (signal.SIGINT, False, b"KeyboardInterrupt"),
        (signal.SIGTERM, False, b""),
        # keel's local backend stops a job's process group: the members are in it
        (signal.SIGKILL, True, b""),
    ],
)
def test_ctrl_c_sigterm_or_a_killed_group_stops_every_member(tmp_path, number, to_group, says):
    member = _member(
        f"""
        import os, time
        replica = os.environ["KEEL_REPLICA"]
        open(os.path.join({str(tmp_path)!r}, "pid-" + replica), "w").write(str(os.getpid()))
        time.sleep(120)
        """
    )
    # Ctrl-C as in a terminal: a test run started in the background (`cmd &`, nohup, CI) has
    # SIGINT ignored, which its children inherit and Python then leaves ignored.
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from keel.core.gang import run_local_gang; run_local_gang({member!r}, 2)",
        ],
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pids = [tmp_path / "pid-0", tmp_path / "pid-1"]
    deadline = time.monotonic() + 30
    while not all(p.exists() and p.read_text() for p in pids):
        assert time.monotonic() < deadline, "the gang did not start"
        time.sleep(0.05)
    if to_group:
        os.killpg(runner.pid, number)
    else:
        runner.send_signal(number)  # to the runner only: it stops the members itself
    _, err = runner.communicate(timeout=30)
    assert runner.returncode != 0 and says in err
    deadline = time.monotonic() + 10
    while any(process_alive(int(pid.read_text())) for pid in pids):
        assert time.monotonic() < deadline, "a member outlived its gang"
        time.sleep(0.05)


@pytest.mark.parametrize("processes", [0, -1, True, 1.5])
def test_a_gang_needs_a_positive_count(processes):
    with pytest.raises(UsageError, match="positive number of processes"):
        run_local_gang(["true"], processes)


def test_a_command_that_does_not_exist_is_one_error(tmp_path):
    with pytest.raises(UsageError, match="cannot start"):
        run_local_gang([str(Path(tmp_path) / "no-such-program")], 2)
