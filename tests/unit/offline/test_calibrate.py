"""Host calibration writes a profile that placement can read."""
from __future__ import annotations

import json
import os

import torch

from powerinfer_ray.offline.calibrate import DEFAULTS, calibrate_host


def _load(path):
    """The profile as placement reads it (plain JSON while placement is not importable)."""
    try:
        from powerinfer_ray.placement.host import HostProfile
    except ImportError:
        return json.loads(path.read_text())
    return HostProfile.load(path)


def _get(prof, name):
    return prof[name] if isinstance(prof, dict) else getattr(prof, name)


def test_calibrate_writes_a_readable_profile(tmp_path):
    lines: list[str] = []
    path = tmp_path / "sub" / "host.json"
    returned = calibrate_host(path, quick=True, log=lines.append)
    data = json.loads(path.read_text())
    prof = _load(path)
    assert prof == returned
    assert _get(prof, "cpu_threads") == os.cpu_count()
    assert 0.1 < _get(prof, "dram_gbs") < 10_000
    assert set(data) >= {"hbm_gbs", "dram_gbs", "pcie_h2d_gbs", "sync_us", "cpu_threads"}
    gpu = tuple(_get(prof, k) for k in ("hbm_gbs", "pcie_h2d_gbs", "sync_us"))
    if not torch.cuda.is_available():  # GPU figures keep DESIGN.md section 2's values
        assert gpu == (DEFAULTS["hbm_gbs"], DEFAULTS["pcie_h2d_gbs"], DEFAULTS["sync_us"])
        assert any("no CUDA" in line for line in lines)
    else:
        assert gpu[0] > 100 and gpu[1] > 1 and 0 < gpu[2] < 10_000
