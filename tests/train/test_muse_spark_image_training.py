"""Image-text SFT of a tiny complete Muse Spark on CPU (examples/tiny-muse-spark-image-sft.yaml): packed image rows
give the loss of a direct forward of the model on each conversation, the vision and audio towers are frozen (no
gradients, no optimizer state) while the adapter and projection train by recipe, the run resumes bitwise, and
``init: checkpoint`` from a complete checkpoint loads the towers with the decoder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrecipes.checkpoint.hf import recipe_model_config
from openrecipes.config.recipe import load_recipe
from openrecipes.config.rundir import rows_directory
from openrecipes.models.muse_spark.hf import TOWER_PREFIXES
from openrecipes.models.registry import get_config
from openrecipes.train.loop import train
from openrecipes.parallel.mesh import single_process
from tests.train.image_reference import example_recipe, per_conversation_loss, train_and_resume

pytest.importorskip("PIL")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-muse-spark-image-sft.yaml"
CONFIG = get_config("muse-spark-tiny-vl")
FROZEN = ("model.vision_tower.patch_embed.", "model.vision_tower.position_embedding.", "model.vision_tower.blocks.",
          "model.vision_tower.post_layernorm.", "model.audio_tower.", "model.audio_projector.")
PROJECTION = ("model.vision_tower.adapter.", "model.multi_modal_projector.")


def _recipe(run_dir: Path, *overrides: str):
    return example_recipe(EXAMPLE, run_dir, *overrides)


def test_packed_rows_give_the_direct_forward_loss(tmp_path: Path) -> None:
    """Rows of several conversations with one or two images each, against a forward of the model on each
    conversation alone (positions from 0, its whole images, no document mask); a row holding part of an image gets
    that part's features."""
    from openrecipes.data.batching import load_rows, make_microbatch
    from openrecipes.models.muse_spark.model import build_muse_spark
    from openrecipes.train import engine

    recipe = _recipe(tmp_path / "run", "data.build.row_tokens=256", "data.build.rows=12")
    dataset = load_rows(rows_directory(None, recipe.run_dir))
    assert dataset.images.image_token_id == CONFIG.image_token_id
    model = build_muse_spark(CONFIG, seed=3)
    placements = dataset.images.placements
    whole = [r for r in range(len(dataset)) if all(
        placements[k, 3] == 0 and placements[k, 2] == placements[k, 4] * placements[k, 5] // 4
        for k in range(dataset.images.row_offsets[r], dataset.images.row_offsets[r + 1]))]
    batch = make_microbatch(dataset, np.array(whole[:3]))
    with torch.no_grad():
        packed = engine.microbatch_loss_sum(model, batch).item()
        blind = engine.microbatch_loss_sum(model, {**batch, "pixel_values": batch["pixel_values"] + 1.0}).item()
    assert packed != blind  # the images reach the loss

    token = CONFIG.image_token_id
    reference, image, two_images = per_conversation_loss(model, batch, token)
    assert image == batch["image_grid_thw"].shape[0] >= 4
    assert two_images, "a conversation with two images after another conversation in its row"
    assert packed == pytest.approx(reference, rel=1e-6)

    # pipelined: image and text microbatches travel with the same one position axis (1-D RoPE), the rows' own
    from openrecipes.train.images import pipeline_image_inputs

    text = {key: batch[key] for key in ("input_ids", "position_ids")}
    piped = pipeline_image_inputs(model, [batch, text])["position_ids"]
    assert torch.equal(piped, torch.cat([batch["position_ids"]] * 2)[:, None])

    # a row holding image tokens 2.. of a 6-token image (a row boundary cut it) gets exactly those features
    grid = torch.tensor([[1, 4, 6]])
    generator = torch.Generator().manual_seed(0)
    patches = torch.randn(24, 3 * 2 * 4 * 4, generator=generator)
    ids = torch.tensor([[token] * 4 + [5, 6, 7]])
    with torch.no_grad():
        cut = model(ids, pixel_values=patches, image_grid_thw=grid, image_tokens_held=torch.tensor([[2, 4]]))
        features = model.model.multi_modal_projector(model.model.vision_tower(patches, grid))[2:]
        h = model.model.language_model.embed_tokens(ids)
        h[0, :4] = features
        embedding, model.model.language_model.embed_tokens = model.model.language_model.embed_tokens, None
        expected = model(h)
        model.model.language_model.embed_tokens = embedding
    assert torch.equal(cut, expected)


def test_example_trains_with_frozen_towers_and_resumes_bitwise(tmp_path: Path) -> None:
    from openrecipes.train import engine

    whole, cut = _recipe(tmp_path / "whole"), _recipe(tmp_path / "cut")
    model, _ = engine.build_model(whole, recipe_model_config(whole), single_process(torch.device("cpu")))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    towers = {name for name in dict(model.named_parameters()) if name.startswith(TOWER_PREFIXES)}
    assert {n for n in towers if n.startswith(FROZEN)} == towers - trained
    assert {n for n in towers if n.startswith(PROJECTION)} == towers & trained != set()
    # the planner counts the same encoder and projection (plan/memory.py: trained or frozen by recipe)
    from openrecipes.models.muse_spark.family import planner_shape

    shape, params = planner_shape(CONFIG, "tiny"), dict(model.named_parameters())
    assert shape.frozen_encoder_params == sum(params[n].numel() for n in towers)
    assert shape.encoder_projection_params == sum(params[n].numel() for n in towers if n.startswith(PROJECTION))
    frozen_recipe = _recipe(tmp_path / "frozen", "vision.train_projection=false")
    frozen, _ = engine.build_model(frozen_recipe, recipe_model_config(frozen_recipe), single_process(torch.device("cpu")))
    assert not any(p.requires_grad for name, p in frozen.named_parameters() if name.startswith(TOWER_PREFIXES))

    keys = train_and_resume(whole, cut)
    state = [k for k in keys if k.startswith("optimizer.state.")]
    assert not any(f".{prefix}" in k for k in state for prefix in FROZEN)  # no optimizer state for the towers
    assert all(any(f".{prefix}" in k for k in state) for prefix in PROJECTION)
    assert any(".language_model." in k for k in state)
    assert all(any(k.startswith(f"model.{prefix}") for k in keys) for prefix in FROZEN)  # their weights are saved


def test_init_from_a_complete_checkpoint_trains_on_images_with_its_towers(tmp_path: Path) -> None:
    """``init: checkpoint`` on image rows reads the complete checkpoint (towers included, nothing skipped); the
    towers stay as loaded, the projection trains, and the export is again a complete checkpoint. Text rows still
    read the text model alone."""
    import warnings

    from openrecipes.checkpoint.hf import recipe_model_config, save_hf
    from openrecipes.models.muse_spark.model import build_muse_spark
    from openrecipes.train import engine
    from tests.checkpoint.test_convert import all_tensors

    source = build_muse_spark(CONFIG, seed=7)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # no tensor at its initial constant, so a tower left at its init shows
        for param in source.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    save_hf(source, tmp_path / "complete")
    recipe = _recipe(tmp_path / "run", f"model={tmp_path / 'complete'}", "init=checkpoint", "steps=2",
                     "checkpoint.every=2", "checkpoint.export_hf=true")
    assert recipe_model_config(recipe) == CONFIG
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # text-only mode would warn about the tower tensors it skips
        model, _ = engine.build_model(recipe, recipe_model_config(recipe), single_process(torch.device("cpu")))
    mine = dict(source.named_parameters())
    assert {n for n, _ in model.named_parameters()} == set(mine)
    assert all(torch.equal(p, mine[name]) for name, p in model.named_parameters())

    train(recipe, command="t")
    exported, saved = all_tensors(tmp_path / "run" / "hf"), all_tensors(tmp_path / "complete")
    assert exported.keys() == saved.keys()
    tower, projection = [n for n in saved if n.startswith(FROZEN)], [n for n in saved if n.startswith(PROJECTION)]
    assert tower and all(torch.equal(exported[n], saved[n]) for n in tower)
    assert projection and not all(torch.equal(exported[n], saved[n]) for n in projection)

    text = load_recipe(EXAMPLE, [f"run_dir={tmp_path / 'text'}", f"model={tmp_path / 'complete'}", "init=checkpoint",
                                 "data.build.input=bundled", "data.build.image_processor=null"])
    assert recipe_model_config(text) == CONFIG.text_only()
