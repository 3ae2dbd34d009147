"""runtime.steplink: the coordinator's step requests over a Unix socket, against the handler called
directly; errors re-raised on the caller's side; a closed executor end raises LinkClosed."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from powerinfer_ray.runtime.steplink import LinkClosed, StepClient, StepServer, peer_uid


def fake_step(slots, tokens, start_pos):  # noqa: ANN001, ANN201
    """Deterministic 'logits' [len(slots), 50000] from the request (a 200 KB payload per row)."""
    if any(p < 0 for p in start_pos):
        raise ValueError(f"start_pos {start_pos}: negative position")
    rows = [np.full(50000, s * 1000.0 + sum(t) + p, np.float32) for s, t, p in zip(slots, tokens, start_pos)]
    rows[0][-1] = len(tokens[0])
    return np.stack(rows)


def _run(main, loop: str):  # noqa: ANN001, ANN202
    """asyncio.run on the default loop or on uvloop (what Ray's async actors, the coordinator
    among them, run on)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(main)
    return asyncio.run(main)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_steps_over_the_link_equal_direct_calls_and_errors_come_back(loop):
    srv = StepServer(fake_step, name="test")
    assert srv.path.startswith("\0")  # abstract: no file in /dev/shm to leave behind if killed
    try:
        async def main():  # noqa: ANN202
            cli = StepClient(srv.path)
            reqs = [([0], [[5, 6, 7]], [0]), ([0, 1, 2], [[1], [2], [3]], [3, 9, 4]), ([3], [list(range(300))], [10])]
            for r in reqs:
                got = await cli.call(*r)
                assert got.dtype == np.float32 and np.array_equal(got, fake_step(*r))
            with pytest.raises(ValueError, match="negative position"):
                await cli.call([0], [[1]], [-1])
            got = await cli.call(*reqs[1])  # the link survives a failed step
            assert np.array_equal(got, fake_step(*reqs[1]))
            cli.close()

        _run(main(), loop)
    finally:
        srv.close()


def test_the_link_times_split_each_call_into_there_step_and_back():
    """The executor's own time (a handler of at least 30 ms) is the step's; the three parts add up
    to no more than the caller's wall time; failed steps count too."""
    import time

    def slow(slots, tokens, start_pos):  # noqa: ANN001, ANN202
        time.sleep(0.03)
        return fake_step(slots, tokens, start_pos)

    srv = StepServer(slow, name="test")
    try:
        async def main():  # noqa: ANN202
            cli = StepClient(srv.path)
            t0 = time.monotonic()
            for r in (([0], [[1]], [0]), ([1], [[2]], [-1]), ([2], [[3]], [4])):
                try:
                    await cli.call(*r)
                except ValueError:
                    pass
            wall = time.monotonic() - t0
            t = dict(cli.times)
            cli.close()
            return t, wall

        t, wall = asyncio.run(main())
        assert t["calls"] == 3 and t["step_s"] >= 3 * 0.03
        assert 0 <= t["there_s"] and 0 <= t["back_s"] and t["there_s"] + t["step_s"] + t["back_s"] <= wall
    finally:
        srv.close()


def test_a_closed_executor_end_raises_link_closed():
    srv = StepServer(fake_step, name="test")
    path = srv.path

    async def main():  # noqa: ANN202
        cli = StepClient(path)
        await cli.call([0], [[1]], [0])
        srv.close()  # the executor goes away (its process dying closes the socket the same way)
        with pytest.raises(LinkClosed, match="died or was stopped"):
            await cli.call([0], [[1]], [0])

    asyncio.run(main())


def test_peer_uid_is_the_connecting_process_user():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_uid(a) == os.getuid()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_peer_of_another_user_gets_no_answer():
    """Requests are pickles: a process of another user is disconnected before anything is read."""
    calls = []
    srv = StepServer(lambda *r: calls.append(r) or np.zeros(1), name="test")
    child = f"""
import os, socket, struct, pickle, sys
try:
    os.setgid(65534); os.setuid(65534)
except PermissionError:  # a root without CAP_SETUID (some containers)
    print("no setuid"); sys.exit(0)
s = socket.socket(socket.AF_UNIX)
s.connect("\\0" + {srv.path[1:]!r})
body = pickle.dumps(([0], [[1]], [0]))
try:
    s.sendall(struct.pack("<Q", len(body)) + body)
    print(repr(s.recv(8)))
except OSError as e:
    print("closed", type(e).__name__)
"""
    try:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        if out.stdout.strip() == "no setuid":
            pytest.skip("this root cannot switch users")
        assert out.stdout.strip() in ("b''", "closed ConnectionResetError", "closed BrokenPipeError"), out.stdout
        assert calls == []

        async def main():  # noqa: ANN202  (the owner still gets served afterwards)
            cli = StepClient(srv.path)
            got = await cli.call([0], [[1]], [0])
            cli.close()
            return got

        assert np.array_equal(asyncio.run(main()), np.zeros(1)) and len(calls) == 1
    finally:
        srv.close()
