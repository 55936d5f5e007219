"""Run declared workloads (bench/workloads.yaml) on this machine, the engine and, where a workload names one, its peer,
each in its own process, rounds interleaved (round 1: engine A, peer A, engine B, ...; then round 2), and write one
results file: date, GPU, driver, torch / transformers / peft versions, every workload's settings and every sample.

Without a GPU the engine trains each family's tiny config and the peer runs --tiny on the CPU (a plumbing check; the
report reads no figure from it).

Usage: python bench/run.py --workloads single_bal_c,dsv3_bal --rounds 2 --out results.json
       python bench/run.py --list
Then: python bench/report.py (after copying the results file into bench/results/) regenerates BENCHMARKS.md's tables.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import PEER_HARNESSES, WORKLOADS_FILE, Workload, default_window, load_workloads, select  # noqa: E402

BENCH = Path(__file__).resolve().parent
FORMAT = "openrecipes-bench/1"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """What the samples ran on: the GPU and its driver (nvidia-smi), and the versions of what they ran."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {"gpu": gpu, "gpu_count": torch.cuda.device_count(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": _version("transformers"), "peft": _version("peft"),
            "python": sys.version.split()[0]}


def engine_command(name: str, out: Path, steps: int | None) -> list[str]:
    return [sys.executable, str(BENCH / "engine_speed.py"), "--variants", name, "--out", str(out)] + \
        (["--steps", str(steps)] if steps else [])


def peer_command(workload: Workload, out: Path, steps: int | None, tiny: bool) -> list[str]:
    """The peer's harness told the workload's shape, steps and window (from the engine's spec: one definition): each
    field its harness takes (workloads.PEER_HARNESSES) as the option of the same name, where the spec or the engine's
    default gives one (the depth only without overrides, which set it, as the engine reads them)."""
    settings = workload.peer_settings()
    spec = workload.engine_spec()
    run_steps = spec.get("steps", steps or 20)
    window = spec.get("window") or default_window(run_steps)
    values = {"model": spec.get("model"), "tiny_model": spec.get("tiny_model"),
              "overrides": json.dumps(spec["overrides"]) if "overrides" in spec else None,
              "layers": None if "overrides" in spec else spec.get("layers", 8), "row_tokens": spec.get("row_tokens", 8192),
              "window": f"{window[0]},{window[1]}"}
    cmd = [sys.executable, str(BENCH.parent / settings["script"]), "--out", str(out), "--steps", str(run_steps),
           "--experts", settings["experts"]]
    for option in PEER_HARNESSES[settings["harness"]].options:
        cmd += [f"--{option.replace('_', '-')}", str(values[option])] if values[option] is not None else []
    cmd += ["--lora"] if "lora" in settings else []  # the harness reads the adapters from workloads.LORA too
    cmd += ["--balanced"] if settings["balanced"] else []
    cmd += [] if settings["recompute"] else ["--no-recompute"]
    return cmd + (["--tiny", "--device", "cpu"] if tiny else [])


def _sample(workload: str, round_: int, side: str, command: list[str], out: Path, wall: float, rc: int) -> dict:
    """One process's result: tokens/s/GPU and peak memory lifted to the top, its whole record kept."""
    sample = {"workload": workload, "round": round_, "side": side, "command": command[1:], "exit": rc,
              "wall_s": wall}
    if not out.is_file():
        return {**sample, "error": f"the process wrote no result (exit {rc})"}
    record = json.loads(out.read_text())
    if side == "engine":
        record = record["results"][0]
        if "error" in record:
            return {**sample, "error": record["error"], "record": record}
        measured = record["measure"]
        tokens, peak = measured.get("tokens_per_s_per_gpu"), measured.get("peak_memory_gib")
    else:
        tokens, peak = record.get("tokens_per_s_window"), record.get("peak_memory_gib")
    return {**sample, "tokens_per_s_per_gpu": tokens, "peak_memory_gib": peak, "record": record}


def _refuse_empty_windows(chosen: dict[str, Workload], steps: int | None) -> None:
    """Before anything runs: a --steps too short for a workload's window would fail its engine after the peer ran."""
    for name, workload in chosen.items():
        spec = workload.engine_spec()
        run_steps = spec.get("steps", steps or 20)
        first, last = spec.get("window") or default_window(run_steps)
        if not 0 <= first <= last < run_steps:
            raise SystemExit(f"{name}: {run_steps} steps leave its window {first}-{last} empty (the default window "
                             f"needs at least {default_window(run_steps)[0] + 2} steps)")


def run(names: str, rounds: int, out: Path, steps: int | None = None, peers: bool = True) -> dict:
    chosen = select(names)
    _refuse_empty_windows(chosen, steps)
    info = machine()
    tiny = info["gpu"] == "cpu"
    report = {"format": FORMAT, "date": time.strftime("%Y-%m-%d"), **info, "tiny": tiny, "rounds": rounds,
              "command": " ".join(["bench/run.py", *sys.argv[1:]]),
              "workloads": {n: {**w.model_dump(exclude_none=True), "engine_spec": w.engine_spec(),
                                **({"peer_settings": w.peer_settings()} if w.peer else {})}
                            for n, w in chosen.items()},
              "samples": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, rounds + 1):
            for name, workload in chosen.items():
                sides = [("engine", None)] + ([("peer", workload)] if workload.peer and peers else [])
                for side, peer_of in sides:
                    part = Path(tmp) / f"{name}-{side}-{round_}.json"
                    command = engine_command(name, part, steps) if peer_of is None else \
                        peer_command(peer_of, part, steps, tiny)
                    print(f"[run] round {round_} {name} {side}: {' '.join(command[1:])}", flush=True)
                    started = time.perf_counter()
                    rc = subprocess.run(command, check=False).returncode
                    sample = _sample(name, round_, side, command, part, time.perf_counter() - started, rc)
                    report["samples"].append(sample)
                    print(f"RESULT {name} round {round_} {side}: {sample.get('tokens_per_s_per_gpu')} tokens/s/GPU, "
                          f"peak {sample.get('peak_memory_gib')} GiB{'; ' + sample['error'] if 'error' in sample else ''}",
                          flush=True)
                    # written after every sample: a later failure loses nothing already measured
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", help="comma-separated names from bench/workloads.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="the results file (bench/results/NAME-GPU.json to keep it; its date is inside)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps of the workloads without their own (a short plumbing run; default theirs)")
    parser.add_argument("--no-peers", action="store_true", help="the engine's samples only (engine variants compared)")
    parser.add_argument("--list", action="store_true", help="print the declared workloads and stop")
    args = parser.parse_args(argv)
    if args.list:
        for name, workload in load_workloads().items():
            peer = f" (beside {workload.peer.harness})" if workload.peer else ""
            print(f"{name}: {workload.description or workload.engine_spec()}{peer}")
        return
    if not args.workloads or not args.out:
        parser.error(f"--workloads and --out are required (the workloads: {WORKLOADS_FILE})")
    report = run(args.workloads, args.rounds, args.out, args.steps, peers=not args.no_peers)
    failed = [s for s in report["samples"] if "error" in s]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
