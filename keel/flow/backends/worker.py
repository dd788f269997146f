"""A local-backend worker process: `python -m keel.flow.backends.worker READ_FD WRITE_FD`.

It reads pickled (task, attempt) messages from one pipe and writes pickled outcomes to the
other, one task at a time, until it reads an empty message or its coordinator goes away.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from keel.flow.backends import run_pickled_task


def serve(receive: Connection, send: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    while True:
        try:
            message = receive.recv_bytes()
        except EOFError:
            return
        if not message:
            return
        send.send_bytes(pickle.dumps(run_pickled_task(message)))


if __name__ == "__main__":
    serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
    # Every task's files are closed and its outcome sent: skip the interpreter's teardown, which
    # spent ~0.3 s freeing a worker's heap (Arrow buffers of the last tasks) at each pool close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
