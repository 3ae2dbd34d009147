"""The coordinator's per-step link to the primary executor: a Unix socket instead of a Ray call.

A Ray actor call costs over a millisecond (``bench sync``: ray_call_us_median), a noticeable
share of a decode step, and a step's logits (4 bytes x vocabulary per sequence) are more than
Ray sends inline. The link carries each step's request and logits over a Unix socket (no
spinning on either side: both block in the kernel). Ray still sets it up (the executor opens it
and returns its path) and carries everything else.

Frames: 8-byte little-endian length, then a pickle. Request: (slots, tokens, start_pos), or
(slots, tokens, start_pos, burst) for a burst of decode steps back to back (``sampling.Burst``).
Response: ("ok", logits, t_recv, t_reply) or ("error", exception, t_recv, t_reply): when the
executor had read the request and when it began to send the answer (``time.monotonic_ns``, one
clock for the host's processes), so the client splits a call's time into the way there, the step
and the way back (``StepClient.times``). When the executor's process dies the kernel
closes its end, and the coordinator's pending read raises `LinkClosed` at once (a coordinator
never reconnects to the same executor: a closed link means a dead one).

The socket has an abstract name (Linux: no file, so nothing is left behind when the executor
is killed before anyone connected). Requests are pickles, so the server accepts only peers of
its own user (SO_PEERCRED).
"""
from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


_LEN = struct.Struct("<Q")
_CREDS = struct.Struct("3i")


class LinkClosed(ConnectionError):
    """The primary executor's end of the step link is gone (it died or was stopped)."""


def _frame(obj: Any) -> bytes:  # noqa: ANN401
    data = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(data)) + data


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    return _CREDS.unpack(creds)[1]  # struct ucred: pid, uid, gid


class StepServer:
    """The executor's end: serves one connection at a time in a daemon thread, calling
    ``handler(slots, tokens, start_pos)`` per request (all steps run in this thread)."""

    def __init__(self, handler: Callable[..., Any], name: str = "step") -> None:
        self.handler = handler
        self.path = f"\0powerinfer-{name}-{uuid.uuid4().hex[:12]}"  # abstract: no file to leave behind
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(1)
        self.closed = False
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, name="step-link", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            if peer_uid(conn) != os.getuid():  # requests are pickles: only this user's processes
                conn.close()
                continue
            self.conn = conn
            with conn:
                while not self.closed:
                    try:
                        head = _recv_exact(conn, _LEN.size)
                        body = None if head is None else _recv_exact(conn, _LEN.unpack(head)[0])
                    except OSError:
                        body = None
                    if body is None:
                        break  # the coordinator went away (or close()): wait for the next one
                    t_recv = time.monotonic_ns()
                    try:
                        reply = ("ok", self.handler(*pickle.loads(body)))
                    except Exception as e:  # noqa: BLE001  (the caller re-raises it)
                        reply = ("error", e)
                    t_reply = time.monotonic_ns()
                    try:
                        data = _frame((*reply, t_recv, t_reply))
                    except Exception:  # noqa: BLE001  (an exception that does not pickle)
                        data = _frame(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"), t_recv,
                                       t_reply))
                    try:
                        conn.sendall(data)
                    except OSError:
                        break

    def close(self) -> None:
        """Stop serving: the listening socket and the open connection (the coordinator's next
        read sees the end at once, as when the process dies)."""
        self.closed = True
        try:
            if self.conn is not None:
                try:
                    self.conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        finally:
            self.sock.close()


class StepClient:
    """The coordinator's end (asyncio): one request in flight at a time. ``times``: seconds summed
    over its calls: ``there`` (from sending a request until the executor had read it), ``step``
    (the executor's handler, pickling included), ``back`` (from its reply until the answer is read
    here), with ``calls``."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()
        self.times = {"calls": 0, "there_s": 0.0, "step_s": 0.0, "back_s": 0.0}

    async def call(self, slots: list[int], tokens: list[list[int]], start_pos: list[int],
                   burst: Any = None) -> Any:  # noqa: ANN401
        """The handler's answer to a step (burst: a ``sampling.Burst``, its decode steps back to back)."""
        req = (slots, tokens, start_pos) + ((burst,) if burst else ())
        async with self.lock:
            try:
                if self.writer is None:  # connected here: uvloop (Ray's async actors) rejects
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # abstract names (EINVAL)
                    try:
                        sock.connect(self.path)  # a local listener: at once
                    except OSError:
                        sock.close()
                        raise
                    self.reader, self.writer = await asyncio.open_unix_connection(sock=sock)
                t_send = time.monotonic_ns()
                self.writer.write(_frame(req))
                await self.writer.drain()
                n = _LEN.unpack(await self.reader.readexactly(_LEN.size))[0]
                status, obj, t_recv, t_reply = pickle.loads(await self.reader.readexactly(n))
                t = self.times
                t["calls"] += 1
                t["there_s"] += (t_recv - t_send) * 1e-9
                t["step_s"] += (t_reply - t_recv) * 1e-9
                t["back_s"] += (time.monotonic_ns() - t_reply) * 1e-9
            except (asyncio.IncompleteReadError, OSError) as e:
                self.close()
                raise LinkClosed(f"the primary executor's step link ({self.path}) closed: the executor "
                                 f"died or was stopped ({type(e).__name__})") from e
        if status == "error":
            raise obj
        return obj

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
