"""LoRA adapters in the PEFT format, and merging one into a Hugging Face checkpoint.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<HF module>.lora_{A,B}.weight``. Native names equal the HF names outside the grouped experts, so a
linear adapter's key is its native name with that prefix. Expert adapters use PEFT's ``target_parameters`` form on the
HF fused parameters ``mlp.experts.gate_up_proj`` (E, 2F, D) and ``mlp.experts.down_proj`` (E, D, F): for a parameter of
E experts, ``lora_A.weight`` is (E·r, in) (expert e's A in rows e·r ... e·r + r - 1) and ``lora_B.weight`` is
(out, r·E) with column k·E + e holding column k of expert e's B. PEFT wraps the targeted parameters of one module in
the order the module registers them (gate_up_proj innermost), whatever order ``target_parameters`` lists them in, so
with both targeted the gate_up adapter's keys read ``...mlp.experts.base_layer.lora_A.weight`` and the down adapter's
``...mlp.experts.lora_A.weight``. Reading an adapter (what is merged, what is refused) is ``lora_reader``'s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from openrecipes.checkpoint.adapter_checksums import (forget_adapter_checksums, verify_adapter_checksums,
                                                     write_adapter_checksums)
from openrecipes.checkpoint.lora_reader import (EXPERT_PARAMETER_NAMES, PREFIX, AdapterConfig, adapter_factors,
                                               read_adapter_config, read_adapter_tensors)
from openrecipes.models.common.hf_experts import FusedHalf, Part, Rearranged
from openrecipes.models.common.lora import EXPERTS, LINEAR_TARGETS, LoraSpec
from openrecipes.models.families import ModelFamily, family_for_config, family_for_model

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
EXPERT_PARAMETERS = tuple(f"mlp.experts.{name}" for name in EXPERT_PARAMETER_NAMES)  # target_parameters
_NATIVE_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.lora_(gate_up|down)\.lora_([AB])$")


def _peft_expert_key(module: str, which: str, factor: str) -> str:
    # the experts register gate_up_proj first, so it is the inner wrapper: one base_layer hop below the outer (down)
    hop = ".base_layer" if which == "gate_up" else ""
    return f"{PREFIX}{module}{hop}.lora_{factor}.weight"


def _interleaved(family: ModelFamily, module: str) -> bool:
    """Whether transformers holds the gate and up rows of ``module``'s gate_up_proj interleaved (gpt-oss) rather than
    as two halves: the family's HF mapping says so."""
    return any(isinstance(part, Rearranged) and part.half is not None
               for _, part in family.native_parts(f"{module}.gate_up_proj"))


def _native_rows(part: Part, delta: torch.Tensor, name: str) -> torch.Tensor:
    """The rows of an expert delta (E, out, in) that a native parameter holds, ``part`` placing it in the HF one (its
    storage orientation is PEFT's concern, not the delta's)."""
    if part is None or (isinstance(part, Rearranged) and part.half is None):
        return delta
    if isinstance(part, FusedHalf):
        width = delta.shape[1] // 2
        return delta[:, part.index * width:(part.index + 1) * width]
    if isinstance(part, Rearranged):
        return delta[:, part.half::2]
    raise ValueError(f"{name}: an adapter of a tensor stored as {part} is not merged")


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapters as PEFT state-dict tensors (contiguous, on the CPU, dtype kept)."""
    out: dict[str, torch.Tensor] = {}
    family: ModelFamily | None = None
    for name, param in model.named_parameters():
        if "lora_" not in name:
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # a DTensor shard (any layout): every rank gathers the whole
            tensor = tensor.full_tensor()
        tensor = tensor.cpu()
        if match := _NATIVE_EXPERT.match(name):
            module, which, factor = match.groups()
            E = tensor.shape[0]
            if factor == "A":  # (E, r, in) -> (E·r, in)
                tensor = tensor.reshape(E * tensor.shape[1], tensor.shape[2])
            else:  # (E, out, r) -> (out, r·E), column k·E + e = B_e[:, k]; gate_up's (E, 2, F, r) is (E, 2F, r)
                family = family or family_for_model(model)
                if which == "gate_up" and _interleaved(family, module):
                    tensor = tensor.transpose(1, 2)  # (E, F, 2, r): gate j, up j in rows 2j, 2j + 1
                tensor = tensor.reshape(E, -1, tensor.shape[-1])
                tensor = tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
            out[_peft_expert_key(module, which, factor)] = tensor.contiguous()
        else:
            out[PREFIX + name] = tensor.contiguous()
    return out


def _base_model_reference(base_model: str | None) -> str | None:
    """What ``base_model_name_or_path`` names: a local base directory as an absolute path (peft's auto classes load
    the base from it, wherever they run), any other name (a Hub id) as given."""
    if base_model is not None and Path(base_model).is_dir():
        return str(Path(base_model).resolve())
    return base_model


def peft_config(spec: LoraSpec, base_model: str | None) -> dict[str, Any]:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": _base_model_reference(base_model),
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "target_modules": sorted(t for t in spec.targets if t in LINEAR_TARGETS) or None,
        "target_parameters": list(EXPERT_PARAMETERS) if EXPERTS in spec.targets else None,
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "inference_mode": True, "revision": None, "layers_to_transform": None, "layers_pattern": None,
    }


def _gather_stages(tensors: dict[str, torch.Tensor], stage_group) -> dict[str, torch.Tensor]:
    """Every pipeline stage's adapters (each holds its own layers'), merged: the whole model's."""
    import torch.distributed as dist

    stages: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(stage_group)
    dist.all_gather_object(stages, tensors, group=stage_group)  # our own ranks' CPU tensors
    return {key: value for stage in stages for key, value in (stage or {}).items()}


def save_peft_adapter(model: nn.Module, spec: LoraSpec, out: str | Path, *, base_model: str | None = None,
                      write: bool = True, stage_group=None) -> Path:
    """Write ``out``/adapter_config.json and adapter_model.safetensors (each atomically), then the checksum file
    (``adapter_checksums``) that merge-lora checks them against. Under a parallel layout
    every rank calls it (sharded adapters are gathered, and with ``stage_group`` every pipeline stage's layers) and
    only the one with ``write`` writes."""
    from safetensors.torch import save_file

    from openrecipes.utils import atomic_write_path, atomic_write_text

    out = Path(out)
    tensors = peft_tensors(model)
    if stage_group is not None:
        tensors = _gather_stages(tensors, stage_group)
    if not tensors:
        raise ValueError("the model has no LoRA adapters to save")
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    forget_adapter_checksums(out)
    with atomic_write_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(out / CONFIG_FILE, json.dumps(peft_config(spec, base_model), indent=2) + "\n")
    write_adapter_checksums(out)  # beside PEFT's files, which stay as PEFT reads them; merge-lora checks it
    return out


def _read_adapter(adapter: Path) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    config_path, weights_path = adapter / CONFIG_FILE, adapter / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    tensors = read_adapter_tensors(weights_path)
    if not tensors:  # a merge of nothing would write a copy of the base under the adapter's name
        raise ValueError(f"{weights_path}: holds no LoRA tensors, so there is nothing to merge")
    return read_adapter_config(config_path), tensors


def _deltas(config: AdapterConfig, tensors: dict[str, torch.Tensor], source: Path, *, modules: set[str],
            values_of: Callable[[str], int]) -> dict[str, torch.Tensor]:
    """HF parameter name -> s · B A (fp32), from PEFT tensors; an expert parameter's delta is (E, out, in).
    ``modules``: the base's modules (every dotted prefix of its tensor names); ``values_of``: how many values the
    base holds for an HF parameter. A product larger than that is refused before it is built (factors of a million
    rows would make terabytes)."""
    deltas: dict[str, torch.Tensor] = {}
    for factors in adapter_factors(config, tensors, source, modules):
        A, B = factors.A.double(), factors.B.double()
        experts = A.shape[0] // factors.rank if factors.experts else 1
        if experts * B.shape[0] * A.shape[1] > values_of(factors.target):
            raise ValueError(f"{source}: the adapter of {factors.target} (lora_A {tuple(A.shape)}, lora_B "
                             f"{tuple(B.shape)}) changes more values than the base holds there")
        if factors.experts:
            A_E = A.reshape(experts, factors.rank, A.shape[1])
            B_E = B.reshape(B.shape[0], factors.rank, experts).permute(2, 0, 1)
            deltas[factors.target] = (torch.bmm(B_E, A_E) * factors.scaling).float()
        else:
            deltas[factors.target] = (B @ A * factors.scaling).float()
    return deltas


def _dotted_prefixes(names: Iterable[str]) -> set[str]:
    """Every module a tensor name lies in: ``a.b.c.weight`` -> ``a``, ``a.b``, ``a.b.c``."""
    parts = (name.split(".") for name in names)
    return {".".join(split[:end]) for split in parts for end in range(1, len(split))}


def merge_lora(base: str | Path, adapter: str | Path, out: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Write base + s·BA as a Hugging Face checkpoint directory ``out``; return a summary."""
    from openrecipes.checkpoint.hf import from_hf, save_hf
    from openrecipes.checkpoint.safetensors_io import HF_MARKER, HF_WRITER, HFCheckpoint
    from openrecipes.utils import check_output_dir

    adapter = Path(adapter)
    verify_adapter_checksums(adapter)  # a changed byte is named before any is read (an adapter from elsewhere: none)
    inputs = (base, adapter)
    check_output_dir(out, marker=HF_MARKER, writer=HF_WRITER, overwrite=overwrite, inputs=inputs)  # before reading
    config, tensors = _read_adapter(adapter)
    model = from_hf(base)
    native = dict(model.named_parameters())
    family = family_for_config(model.config)
    largest = max(param.numel() for param in native.values())

    def values_of(name: str) -> int:  # a name the base lacks: bounded by its largest tensor, then named below
        return sum(native[target].numel() for target, _ in family.native_parts(name) if target in native) or largest

    deltas = _deltas(config, tensors, adapter / WEIGHTS_FILE, modules=_dotted_prefixes(HFCheckpoint(base).keys()),
                     values_of=values_of)
    with torch.no_grad():
        for name, delta in deltas.items():
            # an expert delta is (E, out, in); the native gate and up take their rows of gate_up_proj's
            targets = ([(target, _native_rows(part, delta, name)) for target, part in family.native_parts(name)]
                       if delta.dim() == 3 else [(name, delta)])
            for target, value in targets:
                if target not in native or native[target].shape != value.shape:
                    raise ValueError(f"{adapter / WEIGHTS_FILE}: the adapter changes {target} "
                                     f"{tuple(value.shape)}, which {base} does not have in that shape")
                param = native[target]
                merged = (param.double() + value.double()).to(param.dtype)
                if not bool(torch.isfinite(merged).all()):  # a huge lora_alpha or factors: inf in the merged weight
                    raise ValueError(f"{adapter / WEIGHTS_FILE}: merging makes {target} non-finite in "
                                     f"{str(param.dtype).removeprefix('torch.')} (scaled by lora_alpha "
                                     f"{config.alpha} / r {config.r}); nothing written")
                param.copy_(merged)
    save_hf(model, out, overwrite=overwrite, inputs=inputs)
    return {"base": str(base), "adapter": str(adapter), "out": str(out), "merged_tensors": len(deltas),
            "r": config.r, "lora_alpha": config.alpha}
