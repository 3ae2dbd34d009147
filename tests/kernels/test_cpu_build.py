"""kernels.cpu_library.build: the source compiles as one unit per UNITS entry, side by side, then
links; a unit's compiler error reaches the caller. The compiler here is a script that logs its
arguments and writes its output file (or fails on one unit), so the units and the link are seen."""
from __future__ import annotations

import pytest

from powerinfer_ray.kernels import cpu_library


def _fake_cxx(tmp_path, fail_unit: int | None = None):
    log = tmp_path / "calls.log"
    script = tmp_path / "cxx"
    fail = f'case "$*" in *-DPI_W={fail_unit}\\ *) echo "unit {fail_unit} broken" >&2; exit 1;; esac' \
        if fail_unit is not None else ""
    script.write_text(f"""#!/bin/sh
echo "$*" >> {log}
[ "$1" = "--version" ] && {{ echo "fake 1.0"; exit 0; }}
{fail}
while [ $# -gt 1 ]; do [ "$1" = "-o" ] && touch "$2"; shift; done
""")
    script.chmod(0o755)
    return str(script), log


def test_build_compiles_every_unit_then_links_once(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_RAY_CACHE", str(tmp_path / "cache"))
    cxx, log = _fake_cxx(tmp_path)
    out = cpu_library.build(cxx=cxx)
    assert out.exists() and out.parent == tmp_path / "cache" / "kernels"
    calls = [c for c in log.read_text().splitlines() if not c.startswith("--version")]
    units = sorted(int(c.split("-DPI_W=")[1].split()[0]) for c in calls if " -c " in c)
    assert units == sorted(cpu_library.UNITS)
    links = [c for c in calls if "-shared" in c]
    assert len(links) == 1 and links[0].count(".o") == len(cpu_library.UNITS)
    assert cpu_library.build(cxx=cxx) == out  # cached: nothing compiled again
    assert len([c for c in log.read_text().splitlines() if " -c " in c]) == len(cpu_library.UNITS)


def test_a_units_compiler_error_reaches_the_caller(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_RAY_CACHE", str(tmp_path / "cache"))
    cxx, _ = _fake_cxx(tmp_path, fail_unit=2)
    with pytest.raises(RuntimeError, match="could not build sparse_ffn.cpp:\n(.|\n)*unit 2 broken"):
        cpu_library.build(cxx=cxx)
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))
