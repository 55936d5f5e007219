"""kernels.compile with LoRA adapters: the engine's per-block compile (``parallelize`` with ``compile``) of a LoRA model
compiles each block once, however many layers share it. Every layer's adapted experts must be one class with one
structure: Dynamo caches compiled frames per code object and guards on the module's class, so a class per layer
recompiles the MoE block per layer and, past its recompile limit, leaves the later layers eager.

Dynamo's eager backend traces exactly what the engine's compile traces and needs no C++ compiler."""

import dataclasses

import torch
from torch import nn
from torch._dynamo.utils import counters

from openrecipes.models.common.lora import LoraSpec
from openrecipes.models.qwen3_moe.family import FAMILY
from openrecipes.config.recipe import Kernels
from openrecipes.parallel.mesh import single_process
from openrecipes.parallel.parallelize import ParallelizeOptions, parallelize
from tests.parallel.dynamo_logs import recompile_reasons

LAYERS = 12  # past Dynamo's default recompile limit (8)


def test_compiled_lora_layers_compile_each_block_once(monkeypatch) -> None:
    compile_block = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **options: compile_block(self, backend="eager"))
    config = dataclasses.replace(FAMILY.named_configs["qwen3-moe-tiny"](), num_hidden_layers=LAYERS)
    model = FAMILY.build(config, device="cpu", dtype=torch.float32, seed=0)
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "experts"))
    parallelize(model, single_process(torch.device("cpu")), ParallelizeOptions(compute_dtype=torch.float32, parameter_dtype=torch.float32, seed=0,
                                                kernels=Kernels(compile=True), lora=spec))
    torch._dynamo.reset()
    counters.clear()
    # the first two layers compile the blocks, with whatever recompile Dynamo makes once (a shape it then treats as
    # dynamic); the other ten must reuse those frames
    after_two: list[int] = []
    model.model.layers["1"].register_forward_hook(lambda *_: after_two.append(counters["frames"]["total"]))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with recompile_reasons() as reasons:
        model(ids).float().pow(2).mean().backward()
    assert after_two[0] > 0, "the blocks were not compiled"
    assert counters["frames"]["total"] == after_two[0], \
        f"layers 3-{LAYERS} compiled {counters['frames']['total'] - after_two[0]} more frames"
    # the first layer's input comes from the frozen embedding: it must require grad like every later layer's, or
    # that block's forward compiles a second time (the CPU loop's own helper frames may recompile; blocks may not)
    block_recompiles = [r for r in reasons if r.startswith("Recompiling function forward")]
    assert not block_recompiles, block_recompiles
    trained = {name for name, param in model.named_parameters() if param.grad is not None}
    assert f"model.layers.{LAYERS - 1}.mlp.experts.lora_down.lora_B" in trained
    assert all(".lora_" in name for name in trained)
