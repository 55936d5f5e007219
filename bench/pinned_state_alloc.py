"""Time allocating an offloaded optimizer's pinned host state, three ways, for a recipe's parameter shapes.

  python bench/pinned_state_alloc.py RECIPE.yaml {per_tensor,arena,register,openrecipes} [LAYERS]

per_tensor: what MixedPrecisionAdam did (zeros with pin_memory per parameter: bf16 moments and an int16 remainder);
arena: one pinned buffer per dtype, zeroed once, cut into the parameters' views; register: pageable zeros, then
cudaHostRegister of each buffer; openrecipes: optim/pinned.py's pinned_zeros per parameter, as the optimizer now
allocates it. Prints one JSON line: seconds, GiB asked, and the host allocator's reserved GiB.
"""

import json
import sys
import time

import torch

from openrecipes.config.recipe import load_recipe
from openrecipes.models.families import family_for_config
from openrecipes.train.engine import model_config

recipe, how = load_recipe(sys.argv[1]), sys.argv[2]
if len(sys.argv) > 3:  # fewer layers: the same tensors, fewer of them
    recipe = recipe.model_copy(update={"model_overrides": {**recipe.model_overrides, "num_hidden_layers": int(sys.argv[3])}})
config = model_config(recipe)
model = family_for_config(config).build(config, device="meta", dtype=torch.bfloat16, seed=None)
shapes = [p.shape for p in model.parameters()]
numel = sum(s.numel() for s in shapes)
dtypes = (torch.bfloat16, torch.bfloat16, torch.int16)
torch.cuda.init()
started = time.perf_counter()
held = []
if how == "per_tensor":
    for shape in shapes:
        held += [torch.zeros(shape, dtype=d, pin_memory=True) for d in dtypes]
elif how == "arena":
    for d in dtypes:
        arena = torch.empty(numel, dtype=d, pin_memory=True)
        arena.zero_()
        offset = 0
        for shape in shapes:
            held.append(arena[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
elif how == "register":
    cudart = torch.cuda.cudart()
    for d in dtypes:
        arena = torch.zeros(numel, dtype=d)
        code = cudart.cudaHostRegister(arena.data_ptr(), arena.numel() * arena.element_size(), 0)
        assert int(code) == 0, code
        held.append(arena)
elif how == "openrecipes":
    from openrecipes.optim.pinned import pinned_zeros

    for shape in shapes:
        held += [pinned_zeros(shape, d) for d in dtypes]
else:
    raise SystemExit(f"unknown way {how!r}")
seconds = time.perf_counter() - started
stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
reserved = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0))
print(json.dumps({"way": how, "seconds": round(seconds, 2), "params": numel,
                  "asked_gib": round(numel * 6 / 2**30, 2), "host_allocator_reserved_gib": round(reserved / 2**30, 2),
                  "threads": torch.get_num_threads()}))
