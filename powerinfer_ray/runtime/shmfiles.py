"""Shared-memory files whose owner died: found by the pid in their name and removed.

A channel file (``runtime.channel``) is named ``powerinfer-ray-<pid>-<id>`` after the process
that created it, which removes it when it closes; a process killed with SIGKILL cannot. The
engine sweeps such files when it starts its executors.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .channel import SHM_DIR

log = logging.getLogger(__name__)
PREFIX = "powerinfer-ray-"


def owner_pid(path: Path) -> int | None:
    """The creator's pid from a ``powerinfer-ray-<pid>-...`` name (None for other names)."""
    head = path.name[len(PREFIX):].split("-", 1)[0] if path.name.startswith(PREFIX) else ""
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def sweep_stale(folder: Path = SHM_DIR) -> list[Path]:
    """Remove this project's shared-memory files whose creating process is gone; returns them."""
    removed = []
    for path in folder.glob(PREFIX + "*"):
        pid = owner_pid(path)
        if pid is not None and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("removed %d shared-memory file(s) of dead processes: %s", len(removed), [p.name for p in removed])
    return removed
