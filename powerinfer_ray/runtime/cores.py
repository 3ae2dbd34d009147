"""Cores claimed on one host by the CPU executors that run there, so that engines side by side
(replicas on one node) pin their kernels' workers to different cores.

A claim is a small file in a node-local folder, ``<pid>-<id>``, listing its cores; a claim of a
process that is gone is void (and removed). Claims are taken under a lock on the folder. An
executor alone on its host takes the last cores of its process's CPUs, as before claims existed;
the next takes the last ones still free, and so on, each while ``SPARE`` cores stay free for the
other threads (the primary's driver thread, Ray).
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Sequence

from .channel import SHM_DIR
from .shmfiles import pid_alive

FOLDER = SHM_DIR / "powerinfer-ray-cores"
SPARE = 2  # cores left to the other threads before a CPU executor pins its workers


class CoreClaim:
    """One CPU executor's cores (``take``), given back by ``release`` or by its process's end."""

    def __init__(self, folder: Path = FOLDER) -> None:
        self.folder = folder
        self.path = folder / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.cores: list[int] = []

    def take(self, n: int, cpus: Sequence[int]) -> list[int]:
        """The last ``n`` of ``cpus`` that no other live claim holds, now held by this claim (in place
        of what it held), when ``SPARE`` more stay free; else none (the workers run unpinned)."""
        self.folder.mkdir(exist_ok=True)
        with open(self.folder / "lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = self._others()
            free = [c for c in cpus if c not in taken]
            self.cores = free[-n:] if n + SPARE <= len(free) else []
            self.path.write_text(json.dumps(self.cores))
        return self.cores

    def _others(self) -> set[int]:
        """The cores of the other live claims; the claims of processes that are gone are removed."""
        taken: set[int] = set()
        for f in self.folder.glob("*-*"):
            head = f.name.split("-", 1)[0]
            if f == self.path or not head.isdigit():
                continue
            if not pid_alive(int(head)):
                f.unlink(missing_ok=True)
                continue
            try:
                taken.update(json.loads(f.read_text()))
            except (OSError, ValueError):  # removed meanwhile
                continue
        return taken

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        self.cores = []
