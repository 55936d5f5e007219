"""Training on image rows, written once against the family contract (``ModelFamily.images``): which modules train,
whether rows and model agree, which layouts run, and the image inputs handed to the model's forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from openrecipes.config.recipe import Recipe
from openrecipes.data.image_batch import IMAGE_INPUTS


def image_family(config: Any):
    """The ``ImageInputs`` of the config's family, or None for a text-only model."""
    from openrecipes.models.families import family_for_config

    return family_for_config(config).images


def trainable_modules(recipe: Recipe, config: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(frozen, trained) module paths for ``ParallelizeOptions``: the towers always frozen, the projection as
    ``vision.train_projection`` says (trained even on a LoRA-frozen base)."""
    images = image_family(config)
    if images is None:
        if not recipe.vision.train_projection:
            raise ValueError(f"vision.train_projection: {recipe.model} takes no images (its family declares no "
                             "vision towers); leave the vision section out")
        return (), ()
    if recipe.vision.train_projection:
        return images.towers, images.projection
    return images.towers + images.projection, ()


def check_rows_directory(recipe: Recipe, rows: Path) -> None:
    """``check_image_rows`` for a built rows directory (the launcher runs it before any training process starts)."""
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest
    from openrecipes.train.engine import model_config

    if (rows / MANIFEST_FILE).is_file():
        check_image_rows(recipe, model_config(recipe), read_manifest(rows).get("images"), recipe.layout)


def check_image_rows(recipe: Recipe, config: Any, rows: dict[str, Any] | None, layout: Any) -> None:
    """Refuse rows with images (``rows``: their manifest's ``images`` section, None for text rows) the model cannot
    take: a text-only model, another image token or patch geometry than the model's, or a layout that does not run
    image rows yet (each error names the field)."""
    if not rows:
        return
    images = image_family(config)
    if images is None:
        raise ValueError(f"data: the rows hold images, and model {recipe.model} takes none (build them without "
                         "image_processor, or train a model whose family takes images)")
    if rows["image_token_id"] != images.image_token_id(config):
        raise ValueError(f"data: the rows' image token id is {rows['image_token_id']}, the model's "
                         f"{images.image_token_id(config)} (data.build.tokenizer and model disagree)")
    processor = rows["processor"]
    geometry = (processor["patch_size"], processor["temporal_patch_size"], processor["merge_size"])
    if geometry != tuple(images.patch_geometry(config)):
        raise ValueError(f"data.build.image_processor: patch, temporal patch and merge sizes {geometry} differ from "
                         f"the model's {tuple(images.patch_geometry(config))}")
    for name in ("pp", "tp"):
        if getattr(layout, name) > 1:
            raise ValueError(f"layout.{name}: image rows train with data, expert and context parallelism only so far "
                             f"(towers on the first pipeline stage and tensor parallelism beside the towers are not "
                             f"built yet); set layout.{name}: 1")
    if recipe.kernels.loss_chunk_tokens:
        raise ValueError("kernels.loss_chunk_tokens: not supported with image rows yet; set it to 0")


def image_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keywords of the model's forward for the images of ``batch`` (none for text rows)."""
    return {key: batch[key] for key in IMAGE_INPUTS if key in batch}


def sliced_image_inputs(model: Any, batch: dict[str, torch.Tensor], input_slice: Any
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Context parallelism: this rank's positions and image inputs when ``input_slice`` cuts the rows. The positions
    are computed for the whole rows (images placed in them), then cut; each image keeps only the tokens the slice
    holds (a count of 0 for an image outside it), so the forward merges the features of exactly its image tokens."""
    from openrecipes.models.families import family_for_model

    images = family_for_model(model).images
    config = model.config
    inputs = image_inputs(batch)
    input_ids, held = batch["input_ids"], inputs["image_tokens_held"]
    whole = images.positions(config, input_ids, batch["position_ids"], inputs["image_grid_thw"], held)
    positions = torch.stack([input_slice(axis) for axis in whole])
    rows, tokens = input_ids.shape
    index = input_slice(torch.arange(tokens, device=input_ids.device).expand(rows, tokens))
    low, high = int(index[0, 0]), int(index[0, -1]) + 1  # the slices are contiguous
    flat = (input_ids == images.image_token_id(config)).reshape(-1).nonzero().flatten().tolist()
    kept, cursor = [], 0
    for first, count in held.tolist():
        start = flat[cursor] % tokens if count else 0
        cursor += count
        lo, hi = max(start, low), min(start + count, high)
        kept.append([first + lo - start, hi - lo] if hi > lo else [0, 0])
    return positions, {**inputs, "image_tokens_held": torch.tensor(kept, dtype=held.dtype, device=held.device)}
