"""Make `powerinfer_ray.placement` importable from a source checkout that is not pip-installed.

pyproject maps placement/ onto powerinfer_ray.placement ([tool.setuptools.package-dir]); an
installed (or editable) package already has that mapping, a bare checkout does not.
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _map_placement() -> None:
    try:
        import powerinfer_ray.placement  # noqa: F401  installed: nothing to do
        return
    except ModuleNotFoundError:
        pass
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import powerinfer_ray  # noqa: F401  the parent package, from the checkout

    spec = importlib.util.spec_from_file_location(
        "powerinfer_ray.placement", ROOT / "placement" / "__init__.py",
        submodule_search_locations=[str(ROOT / "placement")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["powerinfer_ray.placement"] = module
    spec.loader.exec_module(module)


_map_placement()
