"""The LoRA workflow on CPU: the example recipe trains only its adapters, resumes bitwise, writes a PEFT adapter,
and its card (`card new`) validates and says `workflow: lora`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.cards.dataset import card_workflow
from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import rows_directory
from openrecipes.data.build import build_recipe_rows
from openrecipes.train.loop import train
from openrecipes.parallel.mesh import single_process
from tests.train.workflow_card import workflow_card

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-lora.yaml"


def _recipe(run_dir: Path):
    recipe = load_recipe(EXAMPLE, [f"run_dir={run_dir}", "steps=4", "global_batch=4", "logging.progress=false",
                                   "checkpoint.every=2", "data.build.rows=8"])
    build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    return recipe


def _metrics(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_lora_example_trains_adapters_and_resumes_bitwise(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    whole, cut = _recipe(tmp_path / "whole"), _recipe(tmp_path / "cut")
    train(whole, command="t")
    train(cut, command="t", stop_after=1)
    assert not (tmp_path / "cut" / "adapter").exists()  # written after the last step only
    train(cut, command="t", resume=True)
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "whole")
    a = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    config = json.loads((tmp_path / "whole" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert card_workflow(whole, {"workflow": "sft"}) == "lora"
    _peft_loads_the_adapter_alone(tmp_path / "whole", tmp_path)
    card = workflow_card(tmp_path / "cut", tmp_path / "whole", tmp_path / "recipes", (1, 3)).card
    assert card.workload.workflow == "lora"


def _peft_loads_the_adapter_alone(run_dir: Path, tmp_path: Path) -> None:
    """A registry model's adapter names the base exported beside it: peft's auto class loads base and adapter from
    the adapter directory alone, and computes the logits of the run's merged export."""
    import os

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import Qwen3MoeForCausalLM

    from openrecipes.checkpoint.training_export import export_training_checkpoint
    from openrecipes.checkpoint.training_save import latest_checkpoint

    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((run_dir / "base").resolve())
    merged_dir = export_training_checkpoint(latest_checkpoint(run_dir), tmp_path / "merged")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    here = os.getcwd()
    os.chdir(elsewhere)
    try:
        peft_model = AutoPeftModelForCausalLM.from_pretrained(run_dir / "adapter", torch_dtype=torch.float32).eval()
    finally:
        os.chdir(here)
    merged = Qwen3MoeForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)


def test_lora_recipe_errors() -> None:
    load_recipe(EXAMPLE, ["layout.etp=2", "layout.ep=2", "layout.dp=4"])  # expert adapters split like experts
    load_recipe(EXAMPLE, ["layout.tp=2", "layout.sequence_parallel=true", "layout.pp=2", "layout.cp=2"])
    with pytest.raises(ValueError, match="dropout must be 0 with the experts target"):
        load_recipe(EXAMPLE, ["lora.dropout=0.1"])
    with pytest.raises(ValueError, match="lora.targets.0"):
        load_recipe(EXAMPLE, ["lora.targets=[gate]"])


def test_only_the_adapters_are_trainable(tmp_path: Path) -> None:
    import torch

    from openrecipes.train import engine

    recipe = _recipe(tmp_path / "run")
    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) < 0.2 * sum(
        p.numel() for p in model.parameters())
