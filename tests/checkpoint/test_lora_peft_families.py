"""LoRA on GLM-4.5-MoE, gpt-oss and Qwen3.5-MoE against peft on transformers' own models (fp32, CPU).

Each family's tiny configs come from its parity test (transformers' tester sizes among them). Three directions:
- our adapters (every B nonzero, so the adapter changes the logits), saved in the PEFT format, loaded by
  ``PeftModel.from_pretrained`` on transformers' model: the same logits;
- one SFT step (loss as transformers' ``labels=``, plain SGD) on our model and on peft's: the same adapters after it;
- adapters made by peft on transformers' model, merged by ``convert merge-lora``: the tensors of peft's own
  ``merge_and_unload`` and its logits, in transformers and in our model.
gpt-oss's experts are stored (in, out) with gate and up interleaved, so a wrong order or orientation of the expert
factors changes the logits; ``test_the_comparison_can_fail`` shows the check sees it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from openrecipes.checkpoint.hf import from_hf
from openrecipes.checkpoint.lora import peft_tensors, save_peft_adapter
from openrecipes.cli import main
from openrecipes.models.common.lora import LoraSpec, apply_lora
from tests.checkpoint.lora_helpers import ours_with_adapters, randomize
from tests.models import test_glm4_moe_parity, test_gpt_oss_parity, test_qwen3_5_moe_parity

peft = pytest.importorskip("peft")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOKENS = 12


@dataclass(frozen=True)
class Family:
    make_hf_model: Callable[..., torch.nn.Module]  # (variant) -> transformers' model, weights perturbed
    variants: tuple[str, ...]                      # parity-test variants checked here
    attention: tuple[str, ...]                     # our linear targets on its mixers (transformers' names)
    # more target_modules for peft-made adapters, and the modules of those peft adapts: on GLM, peft (with
    # transformers 5) reads gate_proj/up_proj/down_proj as a v4 adapter's names of the routed experts, so it adapts
    # the fused experts (gate_up at rank 2r) and neither the dense MLPs nor the shared experts
    peft_modules: tuple[str, ...]
    peft_changes: tuple[str, ...]


FAMILIES = {
    "glm4_moe": Family(test_glm4_moe_parity.make_hf_model, ("tiny", "hf_tester"), ATTENTION,
                       MLP, ()),
    "gpt_oss": Family(test_gpt_oss_parity.make_hf_model, ("tiny", "tight_clamp"), ATTENTION, (), ()),
    "qwen3_5_moe": Family(test_qwen3_5_moe_parity.make_hf_model, ("tiny", "hf_tester"), ATTENTION + LINEAR_ATTENTION,
                          (*MLP, "shared_expert_gate"), (*MLP, "shared_expert_gate")),
}
CASES = [(family, variant) for family, spec in FAMILIES.items() for variant in spec.variants]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _targets(family: str, which: str) -> tuple[str, ...]:
    attention = FAMILIES[family].attention
    return {"attention": attention, "experts": ("experts",), "all": (*attention, "experts")}[which]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Callable[[str, str], Path]:
    """(family, variant) -> a saved transformers checkpoint, written once per module."""
    made: dict[tuple[str, str], Path] = {}

    def base(family: str, variant: str) -> Path:
        if (family, variant) not in made:
            path = tmp_path_factory.mktemp(f"{family}-{variant}") / "base"
            FAMILIES[family].make_hf_model(variant).save_pretrained(path)
            made[family, variant] = path
        return made[family, variant]
    return base


def _hf(base: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()


def _input(model: torch.nn.Module) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("which", ["attention", "experts", "all"])
@pytest.mark.parametrize("family, variant", CASES)
def test_peft_loads_our_adapter_and_gives_our_logits(bases, tmp_path: Path, family, variant, which) -> None:
    base = bases(family, variant)
    spec = LoraSpec(rank=3, alpha=6.0, targets=_targets(family, which))
    ours = ours_with_adapters(base, spec)
    save_peft_adapter(ours, spec, tmp_path / "adapter", base_model=str(base))
    reference = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    ids = _input(ours)
    with torch.no_grad():
        expected, got = reference(input_ids=ids).logits, ours(ids)
        with reference.disable_adapter():
            plain = reference(input_ids=ids).logits
    assert _rel(got, expected) <= 1e-5
    assert _rel(plain, expected) > 1e-2  # the adapter does change the logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_comparison_can_fail(bases, tmp_path: Path, family) -> None:
    """Our experts' gate and up adapters swapped: peft's logits are no longer ours."""
    base = bases(family, "tiny")
    spec = LoraSpec(rank=3, alpha=6.0, targets=("experts",))
    ours = ours_with_adapters(base, spec)
    save_peft_adapter(ours, spec, tmp_path / "adapter")
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("lora_gate_up.lora_B"):
                param.copy_(param.flip(1))
    reference = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    ids = _input(ours)
    with torch.no_grad():
        assert _rel(ours(ids), reference(input_ids=ids).logits) > 1e-3


def _gradients_in_peft_layout(model: torch.nn.Module, read: Callable) -> dict[str, torch.Tensor]:
    """Each adapter's gradient put in its place, so that ``read`` (a PEFT state-dict reader) lays it out."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(param.grad)
    return read(model)


def _our_step(base: Path, spec: LoraSpec, ids: torch.Tensor, dtype: torch.dtype):
    """Our loss (transformers' ``labels=`` loss) and our adapters' gradients in PEFT's layout, in ``dtype``."""
    ours = ours_with_adapters(base, spec, dtype).train()
    logits = ours(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(("lora_" in name) == param.requires_grad for name, param in ours.named_parameters())
    assert all(param.grad is None for name, param in ours.named_parameters() if "lora_" not in name)
    return loss.item(), _gradients_in_peft_layout(ours, peft_tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_sft_gradients_equal_peft(bases, tmp_path: Path, family) -> None:
    """The loss with transformers' labels and its gradient for every adapter (the base frozen, without any): ours,
    in PEFT's layout, are peft's, within fp32 rounding: 1e-5 of the largest entry, or 8 times our own distance from
    float64 where a gradient's sum over tokens cancels more (a wrong gradient is as wrong in float64)."""
    from peft.utils import get_peft_model_state_dict

    base = bases(family, "tiny")
    spec = LoraSpec(rank=3, alpha=6.0, targets=_targets(family, "all"))
    save_peft_adapter(ours_with_adapters(base, spec), spec, tmp_path / "adapter")
    loss, got = _our_step(base, spec, ids := _input(_hf(base)), torch.float32)
    _, exact = _our_step(base, spec, ids, torch.float64)
    reference = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter", is_trainable=True).train()
    expected = reference(input_ids=ids, labels=ids).loss
    assert abs(loss - expected.item()) <= 1e-5 * expected.item()
    expected.backward()
    want = _gradients_in_peft_layout(reference, get_peft_model_state_dict)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert value.abs().max() > 0, key  # every factor of every adapter gets a gradient
        assert _rel(got[key], value) <= max(1e-5, 8 * _rel(got[key].double(), exact[key])), key


def _peft_adapter(base: Path, out: Path, family: str) -> Path:
    """A peft-made adapter on transformers' model: our targets and the family's ``peft_modules``; every factor
    random, some modules at another rank or alpha."""
    spec = FAMILIES[family]
    config = peft.LoraConfig(r=3, lora_alpha=6, target_modules=[*spec.attention, *spec.peft_modules],
                             target_parameters=EXPERT_PARAMETERS, rank_pattern={"o_proj": 5},
                             alpha_pattern={"down_proj": 4})
    model = peft.get_peft_model(_hf(base), config)
    randomize(model, "lora_", seed=3)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family, variant", CASES)
def test_merge_lora_of_a_peft_adapter_equals_peft(bases, tmp_path: Path, capsys, family, variant) -> None:
    base = bases(family, variant)
    adapter = _peft_adapter(base, tmp_path / "adapter", family)
    merged = tmp_path / "merged"
    assert main(["convert", "merge-lora", str(base), str(adapter), "--out", str(merged)]) == 0
    capsys.readouterr()
    reference = peft.PeftModel.from_pretrained(_hf(base), adapter).eval()
    ids = _input(reference.base_model.model)
    with torch.no_grad():
        expected_logits = reference(input_ids=ids).logits
    expected = reference.merge_and_unload().state_dict()
    got, plain = _hf(merged).state_dict(), _hf(base).state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        assert (got[name] - expected[name]).abs().max() <= 2e-6, name
    changed = {name.rsplit(".", 2)[-2] for name in expected if not torch.equal(plain[name], expected[name])}
    assert changed >= {*FAMILIES[family].attention, *FAMILIES[family].peft_changes, "experts"}, changed
    with torch.no_grad():
        assert _rel(_hf(merged)(input_ids=ids).logits, expected_logits) <= 1e-5
        assert _rel(from_hf(merged, dtype=torch.float32)(ids), expected_logits) <= 1e-5


def test_a_target_the_family_lacks_is_refused_by_name(bases) -> None:
    model = from_hf(bases("glm4_moe", "tiny"), dtype=torch.float32)
    with pytest.raises(ValueError, match="the model has no in_proj_qkv to adapt"):
        apply_lora(model, LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "in_proj_qkv")))


def test_a_per_expert_adapter_is_refused_by_name(bases, tmp_path: Path, capsys) -> None:
    """A transformers-4 adapter of GLM's experts, one nn.Linear each (peft converts those on load; merge-lora does
    not): refused in one line naming the tensor."""
    import json

    from safetensors.torch import load_file, save_file

    base = bases("glm4_moe", "tiny")
    adapter = _peft_adapter(base, tmp_path / "adapter", "gpt_oss")  # attention only, no MLP names
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.experts.0.gate_proj.lora_{}.weight"
    tensors.update({key.format("A"): torch.ones(3, 48), key.format("B"): torch.ones(24, 3)})
    save_file(tensors, adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "gate_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert", "merge-lora", str(base), str(adapter), "--out", str(tmp_path / "merged")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "model.layers.1.mlp.experts.0.gate_proj.weight" in error, error
    assert not (tmp_path / "merged").exists()
