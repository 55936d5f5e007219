"""What a finished run writes beside its saves: the last save as a Hugging Face directory (checkpoint.export_hf)
and, for a LoRA run of a registry model, its frozen base, which the PEFT adapter names."""

from __future__ import annotations

import sys
from pathlib import Path

from openrecipes.checkpoint.training_save import latest_checkpoint
from openrecipes.config.recipe import Recipe
from openrecipes.config.rundir import BASE_EXPORT_DIR, HF_EXPORT_DIR


def exports_base(recipe: Recipe) -> bool:
    """A LoRA run of a registry model, saved at its end: no directory holds its base but the save, so the base is
    exported beside the adapter (RUN_DIR/base) for PEFT to load."""
    from openrecipes.models.registry import names

    return recipe.lora is not None and recipe.model in names() and recipe.checkpoint.at_end


def adapter_base(recipe: Recipe, run_dir: Path) -> str:
    """What the adapter names as its base: the exported base of a registry model, else the recipe's model."""
    return str((run_dir / BASE_EXPORT_DIR).resolve()) if exports_base(recipe) else recipe.model


def export_hf(run_dir: Path, name: str = HF_EXPORT_DIR, lora: str = "merged") -> None:
    """checkpoint.export_hf: the save of the last step as a Hugging Face directory, RUN_DIR/hf (a LoRA run's base
    alone: RUN_DIR/base), replacing an earlier export of this run. Rank 0 alone reads the save whole; the other
    ranks have finished."""
    from openrecipes.checkpoint.training_export import export_training_checkpoint

    saved = latest_checkpoint(run_dir)
    out = export_training_checkpoint(saved, run_dir / name, overwrite=True, lora=lora)
    print(f"openrecipes train: exported {saved.name} to {out} (Hugging Face)", file=sys.stderr, flush=True)
