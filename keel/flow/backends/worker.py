"""A local-backend worker process: `python -m keel.flow.backends.worker READ_FD WRITE_FD`.

It reads cloudpickled (task, attempt) messages from one pipe and writes pickled outcomes to the
other, one task at a time, until it reads an empty message or its coordinator goes away.
"""

from __future__ import annotations

import pickle
import signal
import sys
from multiprocessing.connection import Connection

import cloudpickle

from keel.flow.backends import run_task_safely


def serve(receive: Connection, send: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    while True:
        try:
            message = receive.recv_bytes()
        except EOFError:
            return
        if not message:
            return
        try:
            task, attempt = cloudpickle.loads(message)
        except Exception as error:  # e.g. a function whose module this process cannot import
            reason = f"cannot load the task in a worker process: {type(error).__name__}: {error}"
            send.send_bytes(pickle.dumps(("error", reason, False)))
            continue
        send.send_bytes(pickle.dumps(run_task_safely(task, attempt)))


if __name__ == "__main__":
    serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
