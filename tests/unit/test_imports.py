"""The import graph of the package, read from the source (every ``import`` statement, at module
level or inside a function): no cycles, and the layers of DESIGN.md section 4 only import
downward: cli/serve -> actors -> runtime -> kernels, model; offline -> model; placement beside.
Nothing under model, offline, runtime, kernels or placement imports ray; kernels imports only
torch, numpy, triton and the standard library."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# package -> folder (pyproject.toml maps actors/, kernels/, placement/ into the package)
FOLDERS = {"powerinfer_ray": ROOT / "powerinfer_ray", "powerinfer_ray.actors": ROOT / "actors",
           "powerinfer_ray.kernels": ROOT / "kernels", "powerinfer_ray.placement": ROOT / "placement"}
# a layer may import its own package and those of lower rank; placement stands beside, importing
# no other package; the front door (cli, serve, generate, bench) sits on top
RANK = {"front": 5, "actors": 4, "runtime": 3, "offline": 2, "model": 1, "kernels": 1, "placement": 0}
NO_RAY = ("runtime", "offline", "model", "kernels", "placement")
KERNEL_DEPS = {"torch", "numpy", "triton"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for pkg, folder in FOLDERS.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if not any(p.startswith(".") or p in ("csrc", "data") for p in parts):
                out[".".join([pkg, *parts])] = (f, f.name == "__init__.py")
    return out


def imports(name: str, f: Path, is_pkg: bool, mods: dict) -> set[str]:
    """Every module an import statement of the file names (relative ones resolved); ``from a
    import b`` names a.b when that is a module, else a."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names}
    return found


def layer(mod: str) -> str:
    part = mod.split(".")[1] if "." in mod else "front"
    return part if part in RANK else "front"


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, third-party top-level names) per module."""
    mods = modules()
    edges, external = {}, {}
    for name, (f, is_pkg) in mods.items():
        found = imports(name, f, is_pkg, mods)
        edges[name] = {m for m in found if m in mods and m != name}
        external[name] = {m.split(".")[0] for m in found if m and not m.startswith("powerinfer_ray")}
    return edges, external


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_the_package():
    """The checks below are not vacuous: the scan finds the modules and their known imports."""
    edges, external = graph()
    assert len(edges) > 60
    assert "powerinfer_ray.runtime.schedule" in edges["powerinfer_ray.runtime.primary"]
    assert "ray" in external["powerinfer_ray.actors.executors"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(graph()[0])
    assert not found, "import cycles (module-level or in functions): " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_import_downward():
    edges, _ = graph()
    bad = []
    for a, targets in edges.items():
        for b in targets:
            la, lb = layer(a), layer(b)
            if la == lb:
                continue
            if la == "placement" or lb == "front" or RANK[lb] >= RANK[la]:
                bad.append(f"{a} ({la}) imports {b} ({lb})")
    assert not bad, "imports against the layers of DESIGN.md section 4:\n" + "\n".join(sorted(bad))


def test_only_actors_and_the_front_door_import_ray_and_kernels_import_only_torch_numpy_triton():
    _, external = graph()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [f"{m} imports ray" for m, ext in external.items() if layer(m) in NO_RAY and "ray" in ext]
    bad += [f"{m} imports {x}" for m, ext in external.items() if layer(m) == "kernels"
            for x in sorted(ext - stdlib - KERNEL_DEPS)]
    assert not bad, "\n".join(sorted(bad))


def test_the_engine_actors_and_the_config_import_without_torch():
    """The engine's process starts its executors' processes before it imports torch (their
    imports then run beside its own), and the command line builds its flags from the config: a
    fresh interpreter imports these modules without torch."""
    import subprocess

    mods = ["powerinfer_ray.actors.coordinator", "powerinfer_ray.actors.executors", "powerinfer_ray.runtime.config"]
    code = f"import sys; import {', '.join(mods)}; print([m for m in sys.modules if m == 'torch' or m.startswith('torch.')][:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"torch imported: {out.stdout.strip()}"
