"""Cores claimed by the CPU executors of one host: engines side by side pin to different cores,
each leaving two free, and the claims of processes that are gone are void."""
from __future__ import annotations

import json
import subprocess
import sys

from powerinfer_ray.runtime.cores import CoreClaim


def test_engines_side_by_side_take_different_cores(tmp_path):
    cpus = list(range(16))
    a, b, c = (CoreClaim(tmp_path) for _ in range(3))
    assert a.take(6, cpus) == list(range(10, 16))  # alone: the last cores, as a single engine takes
    assert b.take(6, cpus) == list(range(4, 10))
    assert c.take(6, cpus) == []  # 4 left: pinning 6 would leave fewer than two free
    assert c.take(2, cpus) == [2, 3]
    a.release()
    assert b.take(6, cpus) == list(range(10, 16))  # retaken in place of its old cores
    assert a.take(4, cpus) == [6, 7, 8, 9]


def test_a_gone_process_claims_nothing(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{int(dead.stdout)}-old"
    stale.write_text(json.dumps([6, 7]))
    assert CoreClaim(tmp_path).take(2, range(8)) == [6, 7]
    assert not stale.exists()
