"""The per-layer data plane between executors: one shared-memory segment in /dev/shm.

Ray sets it up (the primary creates it and passes its name to the CPU executor through an
actor call) and never touches it again. Per exchange the primary writes the request (header,
hidden states, the CPU shard's active mask), bumps ``req_seq``; the CPU executor spins on
``req_seq``, computes, writes its partial output, sets ``resp_seq``; the primary spins on
``resp_seq``. Both sides spin hot for a short while and then back off to sleeping, so an idle
engine costs no CPU. On x86 (TSO) a store to the data before the store to the flag is seen in
that order by the other process; numpy writes are plain stores. When both sides are threads of
one process (the in-process engine) they ring a condition variable instead of spinning: a
spinning thread holds the interpreter lock that the other side needs to make progress.

Layout (int64 header, then x_attn, x_ffn, out [T_max, D] in the primary's compute dtype (fp16/bf16
on a GPU: half the bytes to copy; the GPU's own partial outputs have that dtype too; sums are
fp32 inside the kernels), then the active-neuron mask packed
eight neurons to a byte, little bit order: an exchange of n_tok tokens and n_mask neurons uses
the first n_tok * ceil(n_mask / 8) bytes as [n_tok, ceil(n_mask / 8)], contiguous (`mask_rows`)):
  0 req_seq   1 resp_seq   2 op   3 layer   4 n_seq   5 n_tok   6 n_mask   7 status
  8 peer_pid  9 (unused)  10 t_start_ns  11 t_end_ns (CLOCK_MONOTONIC, comparable across
  processes)  12 failures (answers with status error, ever)  13 busy_ns (the peer's compute, summed)
  16.. slots[B_max]   16+B_max.. start_pos[B_max]
(The CPU executor's compiled serving loop reads and writes this header too: csrc pi_serve's H_*.)
A decode step's graph posts and awaits by itself (``graphs.DecodeGraphs``): the GPU writes the
request's fields and req_seq and polls resp_seq in the page-locked header, and the primary's
host thread only waits for the step's end (``Exchange.wait_step``), reading failures and
busy_ns before and after.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..kernels.predictor import pack_bool_bits

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")

# ops
OP_ATTN, OP_FFN, OP_ATTN_FFN, OP_STOP, OP_PING = 1, 2, 3, 4, 5
STATUS_OK, STATUS_ERROR = 0, 1
(_H_REQ, _H_RESP, _H_OP, _H_LAYER, _H_NSEQ, _H_NTOK, _H_NMASK, _H_STATUS, _H_PID, _H_TCOMP,
 _H_TSTART, _H_TEND, _H_FAILS, _H_BUSY) = range(14)
REQUEST_FIELDS = slice(_H_OP, _H_NMASK + 1)  # op, layer, n_seq, n_tok, n_mask
ABORTED = 1 << 62  # resp_seq when the primary gave up on the peer: every wait for an answer ends
GIVEN_UP = "the CPU executor was given up on in an earlier step (it died or did not answer); restart the engine"
_HDR_FIXED = 16


class PeerDied(RuntimeError):
    """The executor on the other side of a channel is gone (or stopped answering)."""


class _Bell:
    """Wakeups between the two sides of a channel in one process (see the module docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.local = False  # set when the peer attaches from this process

    def ring(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, ready, timeout_s: float | None, what: str) -> None:  # noqa: ANN001
        """Until ready(): woken by ring(), and polling from every 100 us (a decode graph posts
        without ringing) backing off to every 100 ms while nothing comes."""
        t0, poll = time.perf_counter(), 1e-4
        with self.cond:
            while not ready():
                self.cond.wait(poll)
                poll = min(2 * poll, 0.1)
                if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                    raise PeerDied(f"timed out after {timeout_s:.0f} s waiting for {what}")


_BELLS: dict[str, _Bell] = {}  # channels created by this process, by name


_X_DTYPES = {"f32": (np.float32, torch.float32), "f16": (np.float16, torch.float16),
             "bf16": (np.uint16, torch.bfloat16)}


@dataclass(frozen=True)
class ChannelSpec:
    """What both sides need to map the same segment (sent through Ray once)."""

    name: str
    d: int  # hidden size
    t_max: int  # tokens per exchange
    b_max: int  # sequences per exchange
    n_mask: int  # width of the active-neuron mask (the CPU shard's largest layer)
    x_dtype: str = "f32"  # f32 | f16 | bf16: the hidden states' dtype

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @property
    def header_len(self) -> int:
        return _HDR_FIXED + 2 * self.b_max

    @property
    def mask_bytes(self) -> int:
        return (self.n_mask + 7) // 8

    @property
    def x_bytes(self) -> int:
        return self.t_max * self.d * np.dtype(_X_DTYPES[self.x_dtype][0]).itemsize

    @property
    def nbytes(self) -> int:
        return 8 * self.header_len + 3 * self.x_bytes + self.t_max * self.mask_bytes




def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, n] -> uint8 [N, ceil(n/8)], neuron j in bit j % 8 of byte j // 8 (on mask's device)."""
    return pack_bool_bits(mask)


def unpack_mask(packed: np.ndarray, n: int) -> torch.Tensor:
    """uint8 [N, B] -> bool [N, n] (the inverse of pack_mask)."""
    return torch.from_numpy(np.unpackbits(packed, axis=1, count=n, bitorder="little").view(np.bool_))


class Channel:
    """One side of a shared-memory channel. ``Channel.create`` on the primary, ``attach`` on the peer."""

    def __init__(self, spec: ChannelSpec, create: bool) -> None:
        self.spec = spec
        if create:
            with open(spec.path, "wb") as fh:
                fh.truncate(spec.nbytes)
        fd = os.open(spec.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, spec.nbytes)
        finally:
            os.close(fd)
        buf = np.frombuffer(self._mm, dtype=np.uint8)
        off = 8 * spec.header_len
        self.header = buf[:off].view(np.int64)  # [header_len]
        np_dt, torch_dt = _X_DTYPES[spec.x_dtype]
        xb = spec.x_bytes

        def x_view(start: int) -> torch.Tensor:
            t = torch.from_numpy(buf[start:start + xb].view(np_dt).reshape(spec.t_max, spec.d))
            return t.view(torch_dt) if spec.x_dtype == "bf16" else t

        self.x_attn, self.x_ffn = x_view(off), x_view(off + xb)  # [T_max, D] each
        self.out = x_view(off + 2 * xb)  # [T_max, D]: the CPU executor's partial output
        self.mask_np = buf[off + 3 * xb:]  # [T_max * ceil(N_max/8)]: see mask_rows
        self.mask = torch.from_numpy(self.mask_np)
        self.slots = self.header[_HDR_FIXED:_HDR_FIXED + spec.b_max]
        self.start_pos = self.header[_HDR_FIXED + spec.b_max:_HDR_FIXED + 2 * spec.b_max]
        self.peer_pid = 0
        self.pinned = False
        self._bell: _Bell | None = None

    @classmethod
    def create(cls, d: int, t_max: int, b_max: int, n_mask: int, x_dtype: str = "f32") -> "Channel":
        spec = ChannelSpec(f"powerinfer-ray-{os.getpid()}-{uuid.uuid4().hex[:8]}", d, t_max, b_max, max(n_mask, 1),
                           x_dtype)
        ch = cls(spec, create=True)
        ch._bell = _BELLS[spec.name] = _Bell()
        return ch

    @classmethod
    def attach(cls, spec: ChannelSpec) -> "Channel":
        if not spec.path.exists():
            raise FileNotFoundError(f"shared-memory channel {spec.path} does not exist (the primary "
                                    "executor must create it on the same node)")
        ch = cls(spec, create=False)
        ch.header[_H_PID] = os.getpid()
        ch._bell = _BELLS.get(spec.name)
        if ch._bell is not None:  # the creator is a thread of this process
            ch._bell.local = True
        return ch

    @property
    def in_process(self) -> bool:
        """Whether both sides are threads of this process (they wait on a condition variable)."""
        return self._bell is not None and self._bell.local

    def pin_for_cuda(self) -> None:
        """Page-lock the segment (cudaHostRegister) so D2H/H2D copies are true async DMA."""
        if self.pinned or not torch.cuda.is_available():
            return
        self.pinned = pin_host(self.header.ctypes.data, self.spec.nbytes, "the channel")

    def mask_rows(self, n_tok: int, n_mask: int) -> np.ndarray:
        """The packed mask of an exchange: uint8 [n_tok, ceil(n_mask/8)], a contiguous view."""
        w = (n_mask + 7) // 8
        return self.mask_np[: n_tok * w].reshape(n_tok, w)

    # --- primary side -------------------------------------------------------------------------
    def post(self, op: int, layer: int, n_seq: int, n_tok: int, n_mask: int) -> int:
        """Publish a request whose data is already in the buffers; returns its sequence number."""
        h = self.header
        h[_H_OP], h[_H_LAYER], h[_H_NSEQ], h[_H_NTOK], h[_H_NMASK] = op, layer, n_seq, n_tok, n_mask
        seq = int(h[_H_REQ]) + 1
        h[_H_REQ] = seq  # last store: the peer may read everything above once it sees this
        if self.in_process:
            self._bell.ring()
        return seq

    def wait_response(self, seq: int, timeout_s: float = 60.0, spin_s: float = 0.002) -> tuple[int, int]:
        """Spin until the peer answered request ``seq``; returns the peer's (start, end) times in
        ``time.monotonic_ns`` units, so the caller can split the wait into sync and compute.
        Past spin_s it sleeps in steps of at most 100 us, so that answers slower than the spin
        (dense CPU layers take milliseconds) are still noticed within 100 us."""
        what = f"the CPU executor to answer layer {int(self.header[_H_LAYER])}"
        if self.in_process:
            self._bell.wait(lambda: int(self.header[_H_RESP]) >= seq, timeout_s, what)
        else:
            _wait(lambda: int(self.header[_H_RESP]) >= seq, timeout_s, spin_s, self._peer_alive, what, max_sleep_s=1e-4)
        if self.aborted:
            raise PeerDied(GIVEN_UP)
        if int(self.header[_H_STATUS]) != STATUS_OK:
            raise RuntimeError(f"CPU executor failed on layer {int(self.header[_H_LAYER])}; see its log")
        return int(self.header[_H_TSTART]), int(self.header[_H_TEND])

    def abort(self) -> None:
        """Give up on the peer: every wait for an answer (the GPU's in a decode graph too) ends."""
        self.header[_H_STATUS] = STATUS_ERROR
        self.header[_H_RESP] = ABORTED

    @property
    def aborted(self) -> bool:
        return int(self.header[_H_RESP]) == ABORTED

    def counters(self) -> tuple[int, int, int]:
        """(requests posted, failed answers, the peer's compute in ns), all since creation."""
        h = self.header
        return int(h[_H_REQ]), int(h[_H_FAILS]), int(h[_H_BUSY])

    def wait(self, ready, timeout_s: float, what: str) -> None:  # noqa: ANN001
        """Until ready() (the primary's wait for a decode graph, which talks to the peer itself):
        PeerDied when the peer's process is gone or timeout_s passed."""
        _wait(ready, timeout_s, 0.05, self._peer_alive, what, max_sleep_s=1e-4)

    def _peer_alive(self) -> bool:
        pid = int(self.header[_H_PID])
        if pid <= 0:
            return True  # not attached yet
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    # --- peer side ------------------------------------------------------------------------------
    def wait_request(self, last_seq: int, spin_s: float = 0.002, idle_sleep_s: float = 0.001) -> int:
        """Block until a request newer than ``last_seq`` arrives; returns its sequence number."""
        if self.in_process:
            self._bell.wait(lambda: int(self.header[_H_REQ]) > last_seq, None, "a request")
        else:
            _wait(lambda: int(self.header[_H_REQ]) > last_seq, None, spin_s, None, "a request",
                  max_sleep_s=idle_sleep_s)
        return int(self.header[_H_REQ])

    def request(self) -> tuple[int, int, int, int, int]:
        """op, layer, n_seq, n_tok, n_mask of the request (one slice: half the time of five reads)."""
        return tuple(self.header[REQUEST_FIELDS].tolist())

    def respond(self, seq: int, t_start_ns: int, ok: bool = True) -> None:
        """Publish the answer to request ``seq``; ``t_start_ns`` is when the peer saw it."""
        if self.aborted:  # the primary gave up on this channel (``abort``)
            return
        h = self.header
        h[_H_TSTART], h[_H_TEND] = t_start_ns, time.monotonic_ns()
        h[_H_BUSY] += h[_H_TEND] - t_start_ns
        h[_H_STATUS] = STATUS_OK if ok else STATUS_ERROR
        if not ok:
            h[_H_FAILS] += 1
        h[_H_RESP] = seq
        if self.in_process:
            self._bell.ring()

    def close(self, unlink: bool = False) -> None:
        if self.pinned:  # a later segment mapped at the same address could not be registered
            torch.cuda.cudart().cudaHostUnregister(self.header.ctypes.data)
            self.pinned = False
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive; the mapping goes with the process
        if unlink:
            self.spec.path.unlink(missing_ok=True)
            _BELLS.pop(self.spec.name, None)


def pin_host(addr: int, nbytes: int, what: str, read_only: bool = False) -> bool:
    """Page-lock host memory (cudaHostRegister) so copies from and to it are true async DMA; on
    failure the copies stay correct, only synchronous: warn, and clear CUDA's last error, which
    the next kernel launch check would otherwise raise. read_only: memory mapped without write
    access (cudaHostRegisterReadOnly: the GPU only reads it). Returns whether it is pinned."""
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 8 if read_only else 0))
    if err:
        _clear_cuda_error()
        log.warning("cudaHostRegister of %s failed (error %d): its host copies will not be async", what, err)
    return err == 0


def device_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same bytes as the page-locked host tensor t (with unified
    addressing a registered host page's device address is its host address): the GPU reads it
    over PCIe, nothing is copied."""

    class _Interface:  # what torch.as_tensor reads: the bytes as uint8 rows
        __cuda_array_interface__ = {"shape": (t.shape[0], t.shape[1] * t.element_size()), "typestr": "|u1",
                                    "data": (t.data_ptr(), False), "version": 3,
                                    "strides": (t.stride(0) * t.element_size(), 1)}

    assert t.dim() == 2 and t.stride(1) == 1, "device_view takes row-major matrices"
    return torch.as_tensor(_Interface(), device="cuda").view(t.dtype)


def _clear_cuda_error() -> None:
    """cudaGetLastError() of the CUDA runtime this process loaded (torch exposes no binding)."""
    import ctypes

    try:
        libs = {line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line}
        for path in libs:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _wait(ready, timeout_s, spin_s, alive, what: str, max_sleep_s: float = 0.0005) -> None:  # noqa: ANN001
    """Spin on ``ready()`` for ``spin_s``, then sleep with exponential back-off (capped)."""
    if ready():
        return
    t0 = time.perf_counter()
    spin_until = t0 + spin_s
    while time.perf_counter() < spin_until:
        if ready():
            return
    sleep, checked = 1e-5, t0
    while not ready():
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)
        now = time.perf_counter()
        if now - checked > 0.1:
            checked = now
            if alive is not None and not alive():
                raise PeerDied(f"the executor process died while waiting for {what}")
            if timeout_s is not None and now - t0 > timeout_s:
                raise PeerDied(f"timed out after {timeout_s:.0f} s waiting for {what}")
