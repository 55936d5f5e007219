"""LoRA: our adapters against `peft` on transformers' Qwen3MoeForCausalLM, and merge-lora.

peft (0.17+) expresses expert adapters through `target_parameters` on the fused 3-D expert parameters; the installed
version does, so experts are checked against peft itself, not a hand-written reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openrecipes.checkpoint.hf import from_hf
from openrecipes.checkpoint.lora import save_peft_adapter
from openrecipes.models.common.lora import LoraSpec, apply_lora
from tests.checkpoint.lora_helpers import ours_with_adapters
from tests.models.hf_reference import make_hf_model

peft = pytest.importorskip("peft")

# hidden 32 and 2F = 24 differ, so a swapped in/out dimension cannot pass unnoticed
CONFIG = "pad_token"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "base"
    make_hf_model(CONFIG).save_pretrained(path)
    return path


def _input() -> torch.Tensor:
    return torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"), ("experts",),
                                     ("q_proj", "o_proj", "experts")])
def test_peft_loads_our_adapter_and_gives_our_logits(base_dir: Path, tmp_path: Path, targets) -> None:
    from transformers import Qwen3MoeForCausalLM

    spec = LoraSpec(rank=3, alpha=6.0, targets=targets)
    ours = ours_with_adapters(base_dir, spec)
    save_peft_adapter(ours, spec, tmp_path / "adapter", base_model=str(base_dir))
    hf = Qwen3MoeForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = _input()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with reference.disable_adapter(), torch.no_grad():
        assert (reference(input_ids=ids).logits - expected).abs().max() > 1e-3  # the adapter does change logits


def test_base_is_frozen_and_adapters_train(base_dir: Path) -> None:
    model = from_hf(base_dir, dtype=torch.float32)
    apply_lora(model, LoraSpec(rank=2, alpha=2.0, targets=("q_proj", "experts")))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())  # base names kept
    model(_input()).float().pow(2).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)


def test_lora_errors(base_dir: Path) -> None:
    model = from_hf(base_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="the model has no latent_down_proj to adapt"):
        apply_lora(model, LoraSpec(rank=2, alpha=2.0, targets=("latent_down_proj",)))
    with pytest.raises(ValueError, match="lora.dropout must be 0 with the experts target"):
        apply_lora(from_hf(base_dir), LoraSpec(rank=2, alpha=2.0, dropout=0.1, targets=("experts",)))


def test_merge_lora_equals_base_plus_scaled_ba(base_dir: Path, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    spec = LoraSpec(rank=3, alpha=6.0, targets=("q_proj", "v_proj", "experts"))
    ours = ours_with_adapters(base_dir, spec)
    save_peft_adapter(ours, spec, tmp_path / "adapter")
    import json

    from openrecipes.cli import main

    assert main(["convert", "merge-lora", str(base_dir), str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["merged_tensors"] == 2 * 2 + 2 * 2  # q, v and two expert parameters, in each of 2 layers
    merged = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    ids = _input()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ours(ids), rtol=0, atol=1e-5)
    # the merged q_proj is exactly base + s·BA
    base = Qwen3MoeForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    layer = dict(ours.named_parameters())
    A, B = layer["model.layers.1.self_attn.q_proj.lora_A.weight"], layer["model.layers.1.self_attn.q_proj.lora_B.weight"]
    expected = base.model.layers[1].self_attn.q_proj.weight + 2.0 * (B @ A)
    torch.testing.assert_close(merged.model.layers[1].self_attn.q_proj.weight, expected, rtol=0, atol=1e-6)
    assert load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))


def test_peft_loads_the_base_an_adapter_names_from_anywhere(base_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import json
    import os

    from peft import AutoPeftModelForCausalLM

    spec = LoraSpec(rank=3, alpha=6.0, targets=("q_proj", "experts"))
    monkeypatch.chdir(base_dir.parent)  # the base given relative to where the adapter is written, as a recipe may
    save_peft_adapter(ours_with_adapters(base_dir, spec), spec, tmp_path / "adapter", base_model=base_dir.name)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(written) and Path(written) == base_dir.resolve()
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative name would no longer find the base
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", torch_dtype=torch.float32).eval()
    ids = _input()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours_with_adapters(base_dir, spec)(ids), rtol=0, atol=1e-5)
