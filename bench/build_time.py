"""The model build on the GPU, weights allocated in the compute dtype on the meta device first (``build_on_meta``
now) against allocated in fp32 and cast after (the order before): Qwen3-30B-A3B at LAYERS layers in bf16, each build
in a process of its own, interleaved; the seconds of each phase and the peak allocated and reserved memory. JSON
lines on stdout.

Usage: python bench/build_time.py [LAYERS] [PAIRS]
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r'''
import dataclasses, json, sys, time
import torch
from openrecipes.models.qwen3_moe.family import NAMED_CONFIGS
from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM
from openrecipes.models.common.kernels import KernelOptions
order, layers = sys.argv[1], int(sys.argv[2])
config = dataclasses.replace(NAMED_CONFIGS["qwen3-30b-a3b"](), num_hidden_layers=layers)
torch.cuda.init(); torch.empty(1, device="cuda")
phases, t = {}, time.monotonic()
def mark(name):
    global t
    torch.cuda.synchronize(); now = time.monotonic(); phases[name] = round(now - t, 3); t = now
with torch.device("meta"):
    model = Qwen3MoeForCausalLM(config, KernelOptions())
mark("meta")
if order == "fp32-then-cast":
    model = model.to_empty(device="cuda").to(torch.bfloat16)
else:
    model = model.to(torch.bfloat16).to_empty(device="cuda")
mark("materialise")
model.init_weights(seed=0)
mark("init")
with torch.no_grad():  # no graph holding each fp32 copy
    checksum = float(sum(p.float().abs().sum() for p in model.parameters()))
print(json.dumps({"order": order, "layers": layers, "phases_s": phases, "total_s": round(sum(phases.values()), 3),
                  "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
                  "checksum": checksum}))
'''


def main(layers: int = 48, pairs: int = 2) -> None:
    for index in range(pairs):
        for order in ("fp32-then-cast", "bf16-on-meta"):
            result = subprocess.run([sys.executable, "-c", CHILD, order, str(layers)], capture_output=True, text=True,
                                    timeout=300)
            line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else json.dumps(
                {"order": order, "error": result.stderr.strip()[-400:]})
            print(json.dumps({"pair": index, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
