"""Whether the trial zygote (tune/zygote.py) could import the compiler before it forks, and what that would save: in a
process that has imported what ``openrecipes train`` imports, import one set of compiler modules (none, Dynamo,
Dynamo and Inductor's compile_fx, those and Inductor's Triton runtime; Inductor also with torch's NVML-based CUDA
check), check that torch has not initialised CUDA,
then fork a child that compiles and runs a small function on the GPU (as a forked trial does) and time its first
call; a child that fails reports its error. One process per set, in turn. JSON lines on stdout.

Usage: python bench/compile_preload.py [ROUNDS]
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r'''
import json, os, sys, time
started = time.monotonic()
import openrecipes.train.cli, openrecipes.train.loop
imported = time.monotonic() - started
import importlib
modules = [m for m in sys.argv[1].split(",") if m]
nvml = sys.argv[2] == "nvml"
if nvml:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
t = time.monotonic()
for module in modules:
    importlib.import_module(module)
preload_s = time.monotonic() - t
import torch
parent = {"preload": modules, "nvml_check": nvml, "import_s": round(imported, 3), "preload_s": round(preload_s, 3),
          "cuda_initialized": torch.cuda.is_initialized()}
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    try:
        import traceback
        bad_fork = torch.cuda._is_in_bad_fork()
        os.write(write, json.dumps({"bad_fork": bad_fork}).encode() + b"\n")
        t = time.monotonic()
        x = torch.randn(4096, 4096, device="cuda")
        cuda_s = time.monotonic() - t
        t = time.monotonic()
        f = torch.compile(lambda a: torch.nn.functional.silu(a) * a + 1.0)
        y = f(x)
        torch.cuda.synchronize()
        ok = bool(torch.allclose(y, torch.nn.functional.silu(x) * x + 1.0, atol=1e-3))
        os.write(write, json.dumps({"cuda_init_s": round(cuda_s, 3),
                                    "first_compiled_call_s": round(time.monotonic() - t, 3), "correct": ok}).encode())
        os._exit(0)
    except BaseException:
        os.write(write, json.dumps({"child_error": traceback.format_exc()[-600:]}).encode())
        os._exit(1)
os.close(write)
_, status = os.waitpid(pid, 0)
child = {}
for line in os.read(read, 65536).splitlines():
    child.update(json.loads(line))
print(json.dumps({**parent, **child, "child_exit": os.waitstatus_to_exitcode(status)}))
'''


INDUCTOR = "torch._dynamo,torch._inductor.compile_fx"
# (modules, how torch answers "is CUDA available": "runtime", its default, or "nvml", PYTORCH_NVML_BASED_CUDA_CHECK=1)
PRELOADS = (("", "runtime"), ("torch._dynamo", "runtime"), (INDUCTOR, "runtime"), (INDUCTOR, "nvml"),
            (INDUCTOR + ",torch._inductor.runtime.triton_heuristics", "nvml"))


def main(rounds: int = 1) -> None:
    for index in range(rounds):
        for modules, check in PRELOADS:
            result = subprocess.run([sys.executable, "-c", CHILD, modules, check], capture_output=True, text=True,
                                    timeout=300)
            line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else json.dumps(
                {"preload": modules, "error": result.stderr.strip()[-400:]})
            print(json.dumps({"round": index, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
