"""Training on image rows, written once against the family contract (``ModelFamily.images``): which modules train,
whether rows and model agree, which layouts run, and the image inputs handed to the model's forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from openrecipes.config.recipe import Recipe
from openrecipes.data.image_batch import IMAGE_INPUTS


def image_family(config: Any):
    """The ``ImageInputs`` of the config's family, or None for a text-only model (also a text-only config of a
    multimodal family: its model holds no projection)."""
    from openrecipes.models.families import family_for_config

    images = family_for_config(config).images
    return images if images is not None and images.modules(config) is not None else None


def trainable_modules(recipe: Recipe, config: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(frozen, trained) module paths for ``ParallelizeOptions``: the towers always frozen, the projection as
    ``vision.train_projection`` says (trained even on a LoRA-frozen base)."""
    images = image_family(config)
    if images is None:
        if not recipe.vision.train_projection:
            raise ValueError(f"vision.train_projection: {recipe.model} takes no images (its family declares no "
                             "vision towers); leave the vision section out")
        return (), ()
    towers, projection = images.modules(config)
    if recipe.vision.train_projection:
        return towers, projection
    return towers + projection, ()


def check_rows_directory(recipe: Recipe, config: Any, rows: Path) -> None:
    """``check_image_rows`` for a built rows directory (the launcher runs it before any training process starts)."""
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest

    if (rows / MANIFEST_FILE).is_file():
        check_image_rows(recipe, config, read_manifest(rows).get("images"))


def check_image_rows(recipe: Recipe, config: Any, rows: dict[str, Any] | None) -> None:
    """Refuse rows with images (``rows``: their manifest's ``images`` section, None for text rows) the model cannot
    take: a text-only model, another image token or patch geometry than the model's (each error names the field).
    The layouts image rows run with are the layout rules' (config/layout.py ``layout_problems``), which train
    applies before."""
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


def _placement_rows(input_ids: torch.Tensor, held: torch.Tensor, token_id: int) -> list[int]:
    """The row of each image placement (the k-th run of image tokens in row-major order holds image k's tokens)."""
    flat = (input_ids == token_id).reshape(-1).nonzero().flatten().tolist()
    rows, cursor = [], 0
    for _, count in held.tolist():
        rows.append(flat[cursor] // input_ids.shape[1] if count else 0)
        cursor += count
    return rows


def pipeline_image_inputs(model: Any, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pipeline parallelism: the step's image inputs as tensors the schedule splits by rows, each row carrying its own
    images padded to the step's largest (parallel/pipeline.py ``unpad_images`` undoes it on the first stage), and
    the positions of the whole rows, (rows, axes, T), for every stage. Empty for text rows."""
    from openrecipes.models.families import family_for_model

    if not any("image_grid_thw" in b for b in microbatches):
        return {}
    images = family_for_model(model).images
    config = model.config
    positions, rows = [], []  # rows: per row, its (patches, grid, held) images
    for batch in microbatches:
        inputs = image_inputs(batch)
        input_ids = batch["input_ids"]
        mine: list[list[tuple[torch.Tensor, list[int], list[int]]]] = [[] for _ in range(input_ids.shape[0])]
        if inputs:
            grid, held = inputs["image_grid_thw"], inputs["image_tokens_held"]
            positions.append(images.positions(config, input_ids, batch["position_ids"], grid, held).transpose(0, 1))
            patches = inputs["pixel_values"].split(grid.prod(dim=1).tolist())
            for k, row in enumerate(_placement_rows(input_ids, held, images.image_token_id(config))):
                mine[row].append((patches[k], grid[k].tolist(), held[k].tolist()))
        else:
            positions.append(None)  # the text microbatch's own positions, on as many axes as the image ones'
        rows += mine
    axes = next(p.shape[1] for p in positions if p is not None)
    positions = [p if p is not None else b["position_ids"][:, None].expand(-1, axes, -1)
                 for p, b in zip(positions, microbatches)]
    width = next(b["pixel_values"].shape[1] for b in microbatches if "pixel_values" in b)
    most_patches = max(sum(p.shape[0] for p, _, _ in row) for row in rows)
    most_images = max(len(row) for row in rows)
    pixels = torch.zeros(len(rows), most_patches, width)
    grids = torch.zeros(len(rows), most_images, 3, dtype=torch.long)
    held = torch.zeros(len(rows), most_images, 2, dtype=torch.long)
    for r, row in enumerate(rows):
        if row:
            pixels[r, :sum(p.shape[0] for p, _, _ in row)] = torch.cat([p for p, _, _ in row])
            grids[r, :len(row)] = torch.tensor([g for _, g, _ in row])
            held[r, :len(row)] = torch.tensor([h for _, _, h in row])
    return {"position_ids": torch.cat(positions), "image_pixels": pixels, "image_grids": grids, "image_held": held}
