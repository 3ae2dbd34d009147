"""Waiting on a state, not on a sleep: polled until it holds, failing by name at a timeout."""
from __future__ import annotations

import time

import pytest


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):  # noqa: ANN001, ANN201
    """predicate()'s first true value, polled every ``poll`` s; the test fails naming ``what`` at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)
