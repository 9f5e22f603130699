"""Ctrl-C as a request to stop, not an exception.

The first SIGINT sets a flag that the loops read between passes (the host loop) or between
segments of passes (the device loop) and between compiled shapes during warm-up; the run then ends
early and its outputs are written for the passes done. A second SIGINT raises KeyboardInterrupt
at once, as Python's default does.
"""

from __future__ import annotations

import signal
import threading


def never() -> bool:
    """A stop request that never comes (runs driven from code)."""
    return False


class Interrupt:
    """Call it to ask whether Ctrl-C was pressed since `catch` was called."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def catch(self) -> None:
        """Route SIGINT to this flag (the main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
