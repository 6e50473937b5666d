"""A process's end without the interpreter's module teardown (standard library only: the CLI imports it first).

A process holding torch, TorchTitan, transformers and Monarch spends seconds at
exit tearing their modules down one by one after its last write (a train job's
controller 2.1 s, a role process 1.2 s: docs/tasks.md, "The job's timeline").
`exit_without_teardown` ends such a process with `os._exit` once the exit
handlers registered after it have run, keeping its exit status.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any


def exit_without_teardown() -> None:
    """At this process's exit, once the exit handlers registered after this call have run, end it with
    `os._exit`: the interpreter's module-by-module teardown is skipped, the exit status kept (what
    `sys.exit` was last called with on the main thread, as Monarch's bootstrap passes its runtime's; 1 after
    an uncaught exception, 130 after an uncaught KeyboardInterrupt as a shell reports Ctrl-C)."""
    status: list[Any] = [None]
    sys_exit = sys.exit

    def recording_exit(arg: Any = None) -> None:
        if threading.current_thread() is threading.main_thread():
            status[0] = arg
        sys_exit(arg)

    def end() -> None:
        code = status[0]
        if hasattr(sys, "last_value"):
            # an uncaught exception, already printed
            code = 128 + signal.SIGINT if isinstance(sys.last_value, KeyboardInterrupt) else 1
        elif code is None:
            code = 0
        elif not isinstance(code, int):
            # sys.exit("message") printed the message
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    sys.exit = recording_exit
    atexit.register(end)
