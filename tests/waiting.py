"""Waiting in tests: on an observable condition, with a deadline, never for a fixed time.

A fixed sleep before an assertion is wrong both ways: on a slow machine a "has not happened
yet" check after it passes without testing anything (nothing had started yet either), and
a sleep meant to let something happen fails for no reason when it takes longer.
"""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 30.0,
               interval: float = 0.01) -> bool:
    """True as soon as ``condition()`` is true; False once ``timeout`` seconds have passed
    without it (callers assert on the result, so a missed condition fails the test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)  # the polling interval, not a wait for the condition itself
    return True
