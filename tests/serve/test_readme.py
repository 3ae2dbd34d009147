"""The README's examples run as written against the embedded model: its curl lines and its openai
snippet against ``powerinfer-ray serve`` (on a free port instead of 8000), and its Ray program
snippet in a fresh Python process with its own local Ray."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [body for kind, body in BLOCK.findall(text) if kind == lang]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray, not the tests'


def test_readme_ray_program(tmp_path):
    """The snippet starts its own local Ray (before the server below starts another)."""
    (block,) = [b for b in _blocks("python") if "Coordinator" in b]
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=400, env=_env(),
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'token_ids'" in out.stdout and "'logprobs'" in out.stdout and "gpu_executor" in out.stdout
    assert "'activation': {'counted': True" in out.stdout  # the embedded model runs its predictors
    assert (tmp_path / "traffic" / "activation.parquet").is_file()  # what solve --activation reads


@pytest.fixture(scope="module")
def server(serve_process, free_port, tmp_path_factory):
    """``powerinfer-ray serve`` without -m (the embedded model), as the README starts it; its port."""
    proc = serve_process(["--port", str(free_port())], cwd=str(tmp_path_factory.mktemp("readme")))
    yield int(proc.url.rsplit(":", 1)[1])
    proc.proc.send_signal(signal.SIGINT)
    proc.proc.wait(timeout=90)


def test_readme_curl_lines(server):
    (block,) = [b for b in _blocks("bash") if "curl" in b and "/v1/completions" in b]
    script = block.replace("127.0.0.1:8000", f"127.0.0.1:{server}")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"object":"text_completion"' in out.stdout.replace(" ", ""), out.stdout[:500]
    assert "data: [DONE]" in out.stdout, out.stdout[-500:]
    # no error object in any answer or stream event (generated text may say "error")
    events = [json.loads(line[len("data: "):]) for line in out.stdout.splitlines()
              if line.startswith("data: {")]
    assert events and not any("error" in e for e in events), out.stdout[-500:]
    assert '{"error"' not in out.stdout.replace(" ", ""), out.stdout[:500]


def test_readme_openai_snippet(server):
    (block,) = [b for b in _blocks("python") if "from openai import OpenAI" in b]
    code = block.replace("127.0.0.1:8000", f"127.0.0.1:{server}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip(), "the snippet printed nothing"
