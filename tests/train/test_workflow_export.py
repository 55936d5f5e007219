"""`openrecipes convert export` of the final save of a pretraining run, of a LoRA run (exported merged) and of the
demo-sized SFT run of gpt-oss, GLM-4.5-MoE and Qwen3.5-MoE: the directory transformers loads gives the engine's
logits on the same input (the Qwen3 SFT run's export: test_hf_export.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openrecipes.checkpoint.safe_load import load_dcp
from openrecipes.cli import main
from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import rows_directory
from openrecipes.data.build import build_recipe_rows
from openrecipes.models.common.lora import LoraSpec, apply_lora
from openrecipes.models.families import family_for_config
from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.train import engine
from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.train.loop import train

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _engine_logits(recipe, ckpt: Path, ids: torch.Tensor, *, adapters: bool = True) -> torch.Tensor:
    """The engine's model (with its adapters for a LoRA run) holding the save's weights, in fp32."""
    config = recipe_model_config(recipe)
    model = family_for_config(config).build(config, device="cpu", dtype=torch.float32, seed=0)
    if recipe.lora is not None:
        apply_lora(model, LoraSpec.from_recipe(recipe))
    state = model.state_dict()
    load_dcp({"model": state}, ckpt, no_dist=True)
    if not adapters:  # the base the run started from: its adapters' B back to zero
        for name, tensor in state.items():
            if "lora_B" in name:
                tensor.zero_()
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("example", ["tiny-qwen3-pretrain", "tiny-qwen3-lora", "tiny-gpt-oss-sft", "tiny-glm4-moe-sft",
                                     "tiny-qwen3-5-moe-sft"])
def test_final_save_exports_what_transformers_loads_with_the_engines_logits(example, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = load_recipe(EXAMPLES / f"{example}.yaml", [f"run_dir={tmp_path / 'run'}", "steps=2", "global_batch=2",
                                                         "data.build.rows=4", "logging.progress=false"])
    build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    ckpt = latest_checkpoint(train(recipe, command="t"))
    out = tmp_path / "hf"
    assert main(["convert", "export", str(ckpt), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                 use_safetensors=True).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(out).encode("The river ran past the old mill at dawn.")])
    with torch.no_grad():
        theirs = model(ids).logits
    ours = _engine_logits(recipe, ckpt, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    if recipe.lora is not None:  # merged: the trained adapters are in the exported weights
        assert not any("lora" in name for name, _ in model.named_parameters())
        assert not torch.allclose(_engine_logits(recipe, ckpt, ids, adapters=False), theirs, atol=1e-4)
