"""HostProfile: the measured speeds of the machine the placement is solved for.

Defaults are DESIGN.md section 2's measurements on the GPU host (1 x H200, 16 cores): HBM copy
4190 GB/s, host DRAM read 180 GB/s (16 threads), H2D bulk 55 GB/s, and 45 us for one CPU-GPU
synchronisation of a layer (D2H into pinned shm, flag, CPU answer, H2D). GB = 1e9 bytes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


class HostProfileError(ValueError):
    """A host-profile file or value that cannot describe a machine."""


@dataclass(frozen=True)
class HostProfile:
    """Speeds of one host. host_ram_bytes bounds what the CPU may hold (None: unbounded)."""

    hbm_gbs: float = 4190.0
    dram_gbs: float = 180.0
    pcie_h2d_gbs: float = 55.0
    sync_us: float = 45.0
    cpu_threads: int = 16
    host_ram_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("hbm_gbs", "dram_gbs", "pcie_h2d_gbs"):
            _check_number(name, getattr(self, name), positive=True)
        _check_number("sync_us", self.sync_us, positive=False)
        if not isinstance(self.cpu_threads, int) or isinstance(self.cpu_threads, bool) or self.cpu_threads <= 0:
            raise HostProfileError(f"cpu_threads: expected a positive integer, got {self.cpu_threads!r}")
        if self.host_ram_bytes is not None:
            if not isinstance(self.host_ram_bytes, int) or self.host_ram_bytes <= 0:
                raise HostProfileError(f"host_ram_bytes: expected a positive integer or null, "
                                       f"got {self.host_ram_bytes!r}")

    def cpu_seconds(self, nbytes: float) -> float:
        """Time for the CPU to stream nbytes from host DRAM."""
        return nbytes / (self.dram_gbs * 1e9)

    @property
    def sync_seconds(self) -> float:
        return self.sync_us * 1e-6

    # --- JSON -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "host profile") -> "HostProfile":
        if not isinstance(data, dict):
            raise HostProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise HostProfileError(f"{source}: unknown keys {unknown}; expected some of {sorted(names)}")
        try:
            return cls(**data)
        except HostProfileError as e:
            raise HostProfileError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path | None) -> "HostProfile":
        """Read a profile; a missing file (or None) means the defaults."""
        if path is None or not Path(path).exists():
            return cls()
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise HostProfileError(f"{path}: expected a JSON host profile, got a parse error: {e}; "
                                   f"fix or delete the file (missing = defaults)") from e
        return cls.from_dict(data, source=str(path))


def _check_number(name: str, value: Any, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (positive and value == 0) or value != value:
        want = "a positive number" if positive else "a non-negative number"
        raise HostProfileError(f"{name}: expected {want}, got {value!r}")
