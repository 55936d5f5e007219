import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    """A bench/ script as a module, from its file (bench/ is scripts, not a package); bench/ goes on sys.path for the
    sibling modules the scripts import by their names."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name in sys.modules:  # one copy: the scripts import each other by these names
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the annotations through it
    spec.loader.exec_module(module)
    return module
