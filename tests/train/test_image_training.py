"""Image-text SFT on CPU: packed image rows give the loss of a direct forward of the model on each conversation, the
vision tower is frozen (no gradients, no optimizer state), the projection trains or not by recipe, and the example
recipe resumes bitwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import rows_directory
from openrecipes.train.loop import train
from openrecipes.parallel.mesh import single_process
from tests.train.image_reference import example_recipe, per_conversation_loss, train_and_resume
from tests.train.workflow_card import workflow_card

pytest.importorskip("PIL")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-vl-moe-sft.yaml"


def _recipe(run_dir: Path, *overrides: str):
    return example_recipe(EXAMPLE, run_dir, *overrides)


def test_packed_image_rows_give_the_direct_forward_loss(tmp_path: Path) -> None:
    """Rows of several conversations, with one or two images each, against a forward of the model on each
    conversation alone: its own M-RoPE positions (``mrope_positions``), its whole images, no document mask."""
    from openrecipes.data.batching import load_rows, make_microbatch
    from openrecipes.models.qwen3_vl_moe.model import held_feature_index
    from openrecipes.models.registry import get_config
    from openrecipes.models.families import family_for_config
    from openrecipes.train import engine

    recipe = _recipe(tmp_path / "run", "data.build.row_tokens=256", "data.build.rows=12")
    dataset = load_rows(rows_directory(None, recipe.run_dir))
    config = get_config("qwen3-vl-moe-tiny")
    model = family_for_config(config).build(config, dtype=torch.float32, seed=3)
    images = dataset.images
    whole = [r for r in range(len(dataset)) if all(
        images.placements[k, 3] == 0 and images.placements[k, 2] == images.placements[k, 4] * images.placements[k, 5] // 4
        for k in range(images.row_offsets[r], images.row_offsets[r + 1]))]
    rows = np.array(whole[:3])
    batch = make_microbatch(dataset, rows)
    assert len(rows) == 3 and batch["image_grid_thw"].shape[0] >= 4
    with torch.no_grad():
        packed = engine.microbatch_loss_sum(model, batch).item()

    token_id = config.image_token_id
    reference, image, two_images = per_conversation_loss(model, batch, token_id)
    assert image == batch["image_grid_thw"].shape[0]
    assert two_images, "a conversation with two images after another conversation in its row"
    assert packed == pytest.approx(reference, rel=1e-6)

    # context parallelism: each of two contiguous halves holds the features of exactly its image tokens, an image
    # the cut splits shares its tokens between them, and the positions are the whole rows' cut in two
    from openrecipes.models.qwen3_vl_moe.model import packed_mrope_positions
    from openrecipes.train.images import sliced_image_inputs

    whole_positions = packed_mrope_positions(batch["position_ids"], batch["input_ids"] == config.image_token_id,
                                             batch["image_grid_thw"], batch["image_tokens_held"], config)

    T = batch["input_ids"].shape[1]
    whole = engine.image_inputs(batch)
    whole_index = held_feature_index(whole["image_grid_thw"], whole["image_tokens_held"], 2).tolist()
    cut = int((batch["input_ids"][0] == token_id).nonzero()[0]) + 3  # inside the first image of the first row
    merged, split = [], False
    for half in (slice(0, cut), slice(cut, T)):
        positions, inputs = sliced_image_inputs(model, batch, lambda t, half=half: t[:, half])
        assert torch.equal(positions, whole_positions[:, :, half])
        held = inputs["image_tokens_held"]
        assert int(held[:, 1].sum()) == int((batch["input_ids"][:, half] == token_id).sum())
        split |= bool(((held[:, 1] > 0) & (held[:, 1] < whole["image_tokens_held"][:, 1])).any())
        merged += held_feature_index(inputs["image_grid_thw"], held, 2).tolist()
    assert split and sorted(merged) == sorted(whole_index)

    # a row that holds part of an image gets exactly those tokens' features
    grid = torch.tensor([[1, 8, 12], [1, 8, 8]])
    index = held_feature_index(grid, torch.tensor([[20, 4], [0, 16]]), 2)
    assert index.tolist() == [20, 21, 22, 23, *range(24, 40)]


def _trainable(recipe) -> set[str]:
    from openrecipes.train import engine

    model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    return {name.split(".")[2] for name, p in model.named_parameters() if p.requires_grad and "visual" in name}


def test_towers_frozen_projection_by_recipe(tmp_path: Path, capsys) -> None:
    assert _trainable(_recipe(tmp_path / "a")) == {"merger", "deepstack_merger_list"}
    assert _trainable(_recipe(tmp_path / "b", "vision.train_projection=false")) == set()
    lora = _recipe(tmp_path / "c", "lora.rank=4", "lora.targets=[q_proj,v_proj]")
    assert _trainable(lora) == {"merger", "deepstack_merger_list"}  # trained beside the adapters
    from openrecipes.cli import main

    refused = tmp_path / "refused"
    code = main(["train", str(EXAMPLE), "--set", f"run_dir={refused}", "--set", "layout.tp=2", "--set",
                 "layout.sequence_parallel=true", "--set", "steps=1", "--set", "data.build.rows=4", "--nproc", "2"])
    assert code == 2 and "layout.tp: image rows train with data, expert, context and pipeline" in capsys.readouterr().err
    code = main(["train", str(EXAMPLE), "--set", f"run_dir={refused}", "--set", "layout.pp=2", "--set",
                 "layout.pp_first_stage_layers=1", "--set", "steps=1", "--set", "data.build.rows=4", "--nproc", "2"])
    assert code == 2 and "layout.pp_first_stage_layers: the first pipeline stage runs the vision towers and must " \
        "hold the first 2 decoder layers" in capsys.readouterr().err
    assert not (refused / "metrics.jsonl").exists()  # refused before any training process started
    with pytest.raises(ValueError, match="vision.train_projection: qwen3-moe-tiny takes no images"):
        _trainable(load_recipe(EXAMPLE, [f"run_dir={tmp_path / 'a'}", "model=qwen3-moe-tiny",
                                         "vision.train_projection=false"]))
    with pytest.raises(ValueError, match="data: the rows hold images, and model qwen3-moe-tiny takes none"):
        train(_recipe(tmp_path / "a", "model=qwen3-moe-tiny"), command="t")


def test_example_trains_with_a_frozen_tower_and_resumes_bitwise(tmp_path: Path) -> None:
    whole, cut = _recipe(tmp_path / "whole", "checkpoint.export_hf=true"), _recipe(tmp_path / "cut")
    keys = train_and_resume(whole, cut)
    state = [k for k in keys if k.startswith("optimizer.state.")]
    assert not any(".visual.blocks." in k or ".visual.patch_embed." in k or ".visual.pos_embed." in k for k in state)
    assert any(".visual.merger." in k for k in state) and any(".language_model." in k for k in state)
    assert any(k.startswith("model.model.visual.blocks.") for k in keys)  # the tower's weights are saved
    # the export carries the image processor the rows were sized by (read back as the same config)
    from openrecipes.data import bundled
    from openrecipes.data.images import ImageProcessorConfig

    exported = ImageProcessorConfig.from_hf_json(tmp_path / "whole" / "hf" / "preprocessor_config.json")
    assert exported == ImageProcessorConfig.from_hf_json(bundled.IMAGE_PROCESSOR)
    card = workflow_card(tmp_path / "cut", tmp_path / "whole", tmp_path / "recipes", (1, 3)).card
    assert (card.workload.workflow, card.workload.modality) == ("sft", "image-text")
