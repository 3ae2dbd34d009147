"""The user docs name only result files that exist, link only to files that exist, and the README
stays short.

A result file is any `*.json`, `*.png` or `*.txt` name in the prose of README.md, bench/RESULTS.md
and kernels/README.md (fenced code blocks are commands a user types, whose outputs need not exist):
a bare name lives in bench/results/, a name with a slash is relative to the repository root.
`{a,b}` alternatives and `*` globs are expanded; a glob must match at least one file.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "bench/RESULTS.md", "kernels/README.md")
README_MAX_BYTES = 12 * 1024

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_NAME = re.compile(r"[\w./{},*-]*[\w*}]\.(?:json|png|txt)\b")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _prose(doc: str, root: Path = ROOT) -> str:
    return _FENCE.sub("", (root / doc).read_text(encoding="utf-8"))


def _expand(name: str) -> list[str]:
    """`a-{x,y}-b.json` -> [`a-x-b.json`, `a-y-b.json`] (one level of braces per group)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [e for alt in m.group(1).split(",") for e in _expand(name[:m.start()] + alt + name[m.end():])]


def result_names(doc: str, root: Path = ROOT) -> list[str]:
    return sorted(set(_NAME.findall(_prose(doc, root))))


def missing_results(doc: str, root: Path = ROOT) -> list[str]:
    missing = []
    for name in result_names(doc, root):
        for path in _expand(name):
            base, rel = (root, path) if "/" in path else (root / "bench" / "results", path)
            if not any(base.glob(rel)):
                missing.append(path)
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_result_files_that_exist(doc):
    assert missing_results(doc) == [], f"{doc} names result files that do not exist"


def test_readme_results_table_names_its_json_files():
    # the five-row results table: each row names the JSON file its numbers come from
    names = [n for n in result_names("README.md") if n.endswith(".json")]
    assert len(names) >= 5, names


@pytest.mark.parametrize("doc", DOCS)
def test_docs_link_only_to_files_that_exist(doc):
    text = _prose(doc)
    links = [t for t in _LINK.findall(text) if "://" not in t]
    bad = [t for t in links if not ((ROOT / doc).parent / t).exists()]
    assert bad == [], f"{doc} links to missing files"


def test_readme_is_at_most_12_kib():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}: move detail to docs/"


def test_checker_finds_missing_files_and_expands_alternatives(tmp_path):
    # the checker itself, on a tree written here: two result files, a doc naming them and others
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "runtime-a-h200.json").write_text("{}")
    (results / "runtime-b-h200.json").write_text("{}")
    (tmp_path / "DOC.md").write_text(
        "`runtime-a-h200.json`, `runtime-{a,b,c}-h200.json`, `bench/results/runtime-*-h200.json`,\n"
        "`bench/results/sync-*.json` and plot.png\n"
        "```\npowerinfer-ray calibrate -o host-profile.json\n```\n")
    assert missing_results("DOC.md", tmp_path) == ["bench/results/sync-*.json", "plot.png", "runtime-c-h200.json"]
