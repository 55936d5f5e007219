"""The oracle of packed image rows: the loss of a forward of the model on each conversation alone, with its own
positions and its whole images (no document mask, no packing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_pieces(batch: dict, row: int) -> list[tuple[int, int]]:
    """(start, stop) of each document piece of ``row`` (a document starts where its positions restart at 0)."""
    starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    return list(zip(starts[:-1], starts[1:]))


def per_conversation_loss(model, batch: dict, image_token_id: int) -> tuple[float, int, bool]:
    """Σ weighted cross entropy of every document of the microbatch run alone; also the images it used and whether
    some conversation with two images follows another in its row. Rows must hold whole images."""
    pixels = batch["pixel_values"].split(batch["image_grid_thw"].prod(dim=1).tolist())
    reference, image, two_images = 0.0, 0, False
    for b in range(batch["input_ids"].shape[0]):
        for start, stop in document_pieces(batch, b):
            ids = batch["input_ids"][b, start:stop]
            runs = int(((ids == image_token_id).int().diff() == 1).sum()) + int(ids[0] == image_token_id)
            media = {}
            if runs:
                media = dict(pixel_values=torch.cat(pixels[image:image + runs]),
                             image_grid_thw=batch["image_grid_thw"][image:image + runs])
                two_images |= runs > 1 and start > 0
                image += runs
            with torch.no_grad():
                logits = model(ids[None], **media)[0]
            weights = batch["loss_mask"][b, start + 1:stop].float()
            reference += (F.cross_entropy(logits[:-1], ids[1:], reduction="none") * weights).sum().item()
    return reference, image, two_images


def example_recipe(example, run_dir, *overrides: str):
    """``example`` for a 4-step CPU run in ``run_dir`` (saves every 2 steps, 16 rows), its rows built."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.config.rundir import rows_directory
    from openrecipes.data.build import build_recipe_rows

    recipe = load_recipe(example, [f"run_dir={run_dir}", "steps=4", "logging.progress=false", "checkpoint.every=2",
                                   "data.build.rows=16", *overrides])
    build_recipe_rows(recipe.data.build, rows_directory(None, recipe.run_dir))
    return recipe


def train_and_resume(whole, cut) -> list[str]:
    """Train ``whole`` through; train ``cut`` one step, stop, resume to the end; both runs' losses and gradient norms
    must be equal, the losses falling. Returns the keys of ``whole``'s last save."""
    import json
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader

    from openrecipes.checkpoint.training_save import latest_checkpoint
    from openrecipes.train.loop import train

    def curve(run_dir):
        return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())]

    train(whole, command="t")
    train(cut, command="t", stop_after=1)
    train(cut, command="t", resume=True)
    assert curve(cut.run_dir) == curve(whole.run_dir)
    losses = [loss for loss, _ in curve(whole.run_dir)]
    assert len(losses) == whole.steps and losses[-1] < losses[0]
    return list(FileSystemReader(str(latest_checkpoint(whole.run_dir))).read_metadata().state_dict_metadata)
