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


def run_workload(workload: str, out, steps: int = 7) -> dict:
    """``bench/run.py`` on the CPU for one round of ``workload`` (its tiny models), one thread per process; the
    results file it wrote."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--workloads", workload, "--rounds", "1",
                           "--steps", str(steps), "--out", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())
