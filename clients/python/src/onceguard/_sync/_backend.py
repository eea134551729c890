"""What the sync flavour does its own way: sleeping, and the heartbeat's thread.

Written by hand, with the names of ``_async/_backend.py`` (which uses asyncio); the other
modules of ``_sync`` are generated from ``_async`` by ``scripts/unasync.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

#: A function run under a guard: here a plain function, called.
Job = Callable[[], Any]


def sleep(seconds: float) -> None:
    """Wait ``seconds``, blocking the thread."""
    time.sleep(seconds)


class Periodic:
    """A daemon thread that calls ``beat()`` every ``interval`` seconds, until ``beat`` answers
    ``False`` or :meth:`stop` stops it (and joins it)."""

    def __init__(self, beat: Callable[[], bool], interval: float, *, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if not self._beat():
                return

    def stop(self) -> None:
        """Stop the thread and join it."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
