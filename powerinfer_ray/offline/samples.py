"""Predictor training samples: (predictor input, activation code) per layer and token, kept in
memory up to a cap and spilled to Arrow IPC shards beyond it, read back chunk by chunk.

An activation is stored as a one-byte code of its contribution c = |h_j| * ||down_t[j]|| (how
far it moves the layer output): 0 = inactive, else 1 + 8 log2(c) + 127 clipped to 1..255, i.e.
8 steps per octave over 2^-16..2^16. The mask is code > 0; the magnitudes weight the loss and
the threshold choice, so that the misses that remain are the activations that matter least.

Memory does not grow with the corpus: the store holds at most ``memory_cap`` bytes of buffers
(then it writes the largest layer's buffer as a shard, at most ``memory_cap`` bytes), and
training reads one shard at a time.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from ..model import gguf_keys as K
from ..model.gguf_file import ModelFile
from ..model.reference import ReferenceModel
from .stream import run_windows

_CODE_STEPS, _CODE_ZERO = 8.0, 128.0
DEFAULT_MEMORY_CAP = 256 << 20


def encode_magnitude(c: torch.Tensor) -> torch.Tensor:
    """Contributions c [T, F] (0 where inactive) -> uint8 codes [T, F]."""
    q = (torch.log2(c.clamp_min(1e-30)) * _CODE_STEPS + _CODE_ZERO).round().clamp(1, 255)
    return torch.where(c > 0, q, torch.zeros_like(q)).to(torch.uint8)


def decode_magnitude(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> contributions (0 where inactive), float32."""
    c = torch.exp2((q.float() - _CODE_ZERO) / _CODE_STEPS)
    return torch.where(q > 0, c, torch.zeros_like(c))


class SampleStore:
    """Per-layer samples (x [D] float32, activation code [F] uint8) in one preallocated block per
    layer of ``memory_cap / n_layer`` bytes (a few rows at least); a full block is written as
    an Arrow IPC shard (columns x, code) under ``spill_dir`` (a temporary folder by default)
    and refilled. Fixed blocks, not many small arrays: the process's memory stays at the cap
    instead of growing with allocator fragmentation."""

    def __init__(self, n_layer: int, n_embd: int, n_ff: int, memory_cap: int = DEFAULT_MEMORY_CAP,
                 spill_dir: str | Path | None = None) -> None:
        self.n_layer, self.D, self.F = n_layer, n_embd, n_ff
        self.memory_cap = memory_cap
        self.rows = max(16, memory_cap // (n_layer * (4 * n_embd + n_ff)))  # rows per block
        self._spill_root = Path(spill_dir) if spill_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._x: list[np.ndarray | None] = [None] * n_layer  # [rows, D], allocated on first use
        self._q: list[np.ndarray | None] = [None] * n_layer  # [rows, F]
        self.fill = [0] * n_layer
        self.shards: list[list[Path]] = [[] for _ in range(n_layer)]
        self.counts = [0] * n_layer
        self.active = np.zeros((n_layer, n_ff), dtype=np.int64)
        self.mass = np.zeros(n_layer)  # sum of decoded contributions, for the mean

    # --- writing ------------------------------------------------------------------------------
    def add(self, layer: int, x: torch.Tensor, code: torch.Tensor) -> None:
        """x [T, D]; code [T, F] uint8 (``encode_magnitude``) or bool (active, magnitude 1)."""
        if code.dtype == torch.bool:
            code = code.to(torch.uint8) * int(_CODE_ZERO)
        xa = x.detach().float().cpu().numpy()
        qa = code.detach().cpu().numpy()
        self.active[layer] += (qa > 0).sum(0)
        self.mass[layer] += float(decode_magnitude(code.detach()).sum())
        self.counts[layer] += xa.shape[0]
        if self._x[layer] is None:
            self._x[layer] = np.empty((self.rows, self.D), np.float32)
            self._q[layer] = np.empty((self.rows, self.F), np.uint8)
        done = 0
        while done < xa.shape[0]:
            f = self.fill[layer]
            n = min(self.rows - f, xa.shape[0] - done)
            self._x[layer][f:f + n] = xa[done:done + n]
            self._q[layer][f:f + n] = qa[done:done + n]
            self.fill[layer] += n
            done += n
            if self.fill[layer] == self.rows:
                self._spill(layer)

    def mean_magnitude(self, layer: int) -> float:
        return float(self.mass[layer] / max(self.active[layer].sum(), 1))

    def active_share(self, layer: int) -> float:
        """The share of (token, neuron) pairs active in ``layer``."""
        return float(self.active[layer].sum()) / max(self.counts[layer] * self.F, 1)

    @property
    def spill_dir(self) -> Path:
        if self._spill_root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="predictor-samples-")
            self._spill_root = Path(self._tmp.name)
        self._spill_root.mkdir(parents=True, exist_ok=True)
        return self._spill_root

    def _spill(self, layer: int) -> None:
        import pyarrow as pa

        x, q = self._buffer(layer)
        path = self.spill_dir / f"layer{layer}_shard{len(self.shards[layer])}.arrow"
        batch = pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), self.D),
                                 pa.FixedSizeListArray.from_arrays(pa.array(q.reshape(-1)), self.F)],
                                names=["x", "code"])  # zero-copy views of the block
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        self.shards[layer].append(path)
        self.fill[layer] = 0

    def _buffer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The filled rows of the layer's block (views)."""
        f = self.fill[layer]
        if f == 0:
            return np.zeros((0, self.D), np.float32), np.zeros((0, self.F), np.uint8)
        return self._x[layer][:f], self._q[layer][:f]

    def _read_shard(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        import pyarrow as pa

        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, self.D)
        q = table.column("code").combine_chunks().flatten().to_numpy().reshape(-1, self.F)
        return x.copy(), q.copy()

    # --- reading ------------------------------------------------------------------------------
    def spilled(self, layer: int) -> bool:
        return bool(self.shards[layer])

    def chunks(self, layer: int, rng: np.random.Generator | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(x [N, D], code [N, F]) chunks of at most one block each: each shard, then the
        block's filled rows (views); shard order shuffled when ``rng`` is given."""
        order = list(range(len(self.shards[layer])))
        if rng is not None:
            rng.shuffle(order)
        for i in order:
            yield self._read_shard(self.shards[layer][i])
        if self.fill[layer]:
            yield self._buffer(layer)

    def all(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Every sample of a layer: x [N, D] float32, code [N, F] uint8 (loads shards)."""
        parts = list(self.chunks(layer)) or [self._buffer(layer)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        for shards in self.shards:
            for p in shards:
                p.unlink(missing_ok=True)


class LayerData:
    """One layer's training samples as device tensors: resident when the store never spilled
    the layer (at most ``memory_cap`` bytes), else streamed one shard at a time."""

    def __init__(self, store: SampleStore, layer: int, device: torch.device) -> None:
        self.store, self.layer, self.device = store, layer, device
        self.n = store.counts[layer]
        self.mean_magnitude = store.mean_magnitude(layer)
        self.active_share = store.active_share(layer)
        self.resident: tuple[torch.Tensor, torch.Tensor] | None = None
        if not store.spilled(layer):
            x, q = store.all(layer)
            self.resident = (torch.from_numpy(x).to(device), torch.from_numpy(q).to(device))

    def batches(self, batch: int, gen: torch.Generator, rng: np.random.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled (x [B, D], code [B, F]) batches over every sample once."""
        chunks = [self.resident] if self.resident is not None else (
            (torch.from_numpy(x).to(self.device), torch.from_numpy(q).to(self.device))
            for x, q in self.store.chunks(self.layer, rng))
        for x, q in chunks:
            perm = torch.randperm(x.shape[0], generator=gen).to(self.device)
            for i in range(0, x.shape[0], batch):
                idx = perm[i:i + batch]
                yield x[idx], q[idx]

    def head(self, n: int) -> torch.Tensor:
        """The first ``n`` predictor inputs [<= n, D] (for initialisation)."""
        if self.resident is not None:
            return self.resident[0][:n]
        x, _ = next(self.store.chunks(self.layer))
        return torch.from_numpy(x[:n]).to(self.device)


def down_norms(ref: ReferenceModel) -> list[torch.Tensor]:
    """Per layer, ||down_t[j]|| [F]: an activation h_j contributes |h_j| times this."""
    return [ref.w[K.tensor(K.FFN_DOWN_T, l)].float().norm(dim=1) for l in range(ref.cfg.n_layer)]


def file_down_norms(mf: ModelFile, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """``down_norms`` read from the model file a layer at a time (no reference model)."""
    return [mf.layer(K.FFN_DOWN_T, l).float().norm(dim=1).to(device) for l in range(mf.config.n_layer)]


class CollectHooks:
    """FFNHooks that observe (predictor input, activation codes) into a store; ``down_norms``
    [F] per layer (``down_norms``, ``file_down_norms``), on the device of the activations."""

    def __init__(self, store: SampleStore, down_norms: list[torch.Tensor]) -> None:
        self.store = store
        self.down_norms = down_norms

    def mask(self, layer: int, pred_in: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, pred_in: torch.Tensor, h: torch.Tensor) -> None:
        self.store.add(layer, pred_in, encode_magnitude(h.abs().float() * self.down_norms[layer]))


# what collects the samples of windows of seq_len tokens into a store, another runner than the
# reference: (windows, seq_len, store, total, desc) -> the tokens run (``collect_samples``'s
# progress bar; ``runtime.engine_samples``)
Collector = Callable[[Iterable[list[int]], int, SampleStore, int | None, str | None], int]


def collect_samples(ref: ReferenceModel, windows: Iterable[list[int]], store: SampleStore,
                    total: int | None = None, desc: str | None = None) -> int:
    """Run the dense reference over ``windows`` and store every position's samples; a progress
    bar titled ``desc`` (over ``total`` tokens) when given. Returns the tokens seen."""
    return run_windows(ref, windows, CollectHooks(store, down_norms(ref)), total, desc)
