"""What the benchmarks record as the commit measured (bench/model_bench.py ``commit``): the caller's
$POWERINFER_COMMIT, else git's HEAD, marked "-dirty" when tracked files differ from it (a copied
tree with a stale .git must not pass for the commit it was copied beside)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from powerinfer_ray.bench import load_driver

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def test_commit_is_the_callers_else_heads_marked_dirty(tmp_path, monkeypatch):
    mb = load_driver("model_bench")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *a],  # noqa: E731
                                    cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(mb, "ROOT", tmp_path)
    monkeypatch.delenv("POWERINFER_COMMIT", raising=False)
    assert mb.commit() == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert mb.commit() == f"{head}-dirty"
    monkeypatch.setenv("POWERINFER_COMMIT", "abc1234")
    assert mb.commit() == "abc1234"
