"""The build materialises its weights once, in the target dtype: a cast after ``to_empty`` would first allocate
the whole model in fp32 (twice the bf16 peak; 114 GiB against 59 GiB at Qwen3-30B-A3B's 48 layers)."""

import torch
from torch import nn

from openrecipes.models.common.init import build_on_meta


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def init_weights(self, *, seed: int) -> None:
        torch.manual_seed(seed)
        nn.init.normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)


def test_the_model_is_cast_on_meta_before_it_is_materialised(monkeypatch):
    seen: list[tuple[str, torch.dtype]] = []
    to_empty = nn.Module.to_empty

    def recording_to_empty(module: nn.Module, **kwargs):
        seen.extend((p.device.type, p.dtype) for p in module.parameters())
        return to_empty(module, **kwargs)

    monkeypatch.setattr(nn.Module, "to_empty", recording_to_empty)
    model = build_on_meta(_Tiny, device="cpu", dtype=torch.bfloat16, seed=0)
    assert seen == [("meta", torch.bfloat16)] * 2
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.proj.weight.abs().sum() > 0  # initialised, not left empty


def test_meta_device_returns_the_unmaterialised_model_in_its_dtype():
    model = build_on_meta(_Tiny, device="meta", dtype=torch.bfloat16, seed=0)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
