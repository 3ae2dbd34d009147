"""runtime.steplink: the coordinator's step requests over a Unix socket, against the handler called
directly; errors re-raised on the caller's side; a closed executor end raises LinkClosed."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from powerinfer_ray.runtime.steplink import LinkClosed, StepClient, StepServer


def fake_step(slots, tokens, start_pos):  # noqa: ANN001, ANN201
    """Deterministic 'logits' [len(slots), 50000] from the request (a 200 KB payload per row)."""
    if any(p < 0 for p in start_pos):
        raise ValueError(f"start_pos {start_pos}: negative position")
    rows = [np.full(50000, s * 1000.0 + sum(t) + p, np.float32) for s, t, p in zip(slots, tokens, start_pos)]
    rows[0][-1] = len(tokens[0])
    return np.stack(rows)


def test_steps_over_the_link_equal_direct_calls_and_errors_come_back():
    srv = StepServer(fake_step, name="test")
    assert srv.path.stat().st_mode & 0o777 == 0o600  # requests are pickles: owner only
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
            assert not srv.path.exists()  # connected: the socket's name is gone from /dev/shm
            cli.close()

        asyncio.run(main())
    finally:
        srv.close()
    assert not srv.path.exists()


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
