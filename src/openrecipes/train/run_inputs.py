"""What a run reads, which its run directory must keep apart from (``config.rundir.claim_run_dir``): the recipe
file, the model directory, the rows and what ``data.build`` builds them from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openrecipes.config.rundir import claim_run_dir


def named_run_inputs(recipe: Any) -> dict[str, Path]:
    """The files and directories the run of ``recipe`` reads (the recipe file aside), by the recipe key naming each."""
    from openrecipes.data.manifest import build_inputs
    from openrecipes.models.registry import names

    inputs: dict[str, Path] = {}
    if recipe.model not in names():
        inputs["model"] = Path(recipe.model)
    if recipe.data.rows is not None:
        inputs["data.rows"] = Path(recipe.data.rows)
    if recipe.data.build is not None:
        inputs.update(build_inputs(recipe.data.build))
    return inputs


def run_inputs(recipe: Any, recipe_file: str | Path | None) -> list[Path | None]:
    """The files and directories the run of ``recipe`` reads; ``recipe_file`` is None on a resume (the run's own
    recipe.yaml is then one of its files, not an input)."""
    return [None if recipe_file is None else Path(recipe_file), *named_run_inputs(recipe).values()]


def forget_unused_run_dir(run_dir: Path) -> None:
    """Remove a run directory this command made and left holding its marker only (the run was refused before it
    wrote anything); any other content stays."""
    from openrecipes.config.rundir import RUN_MARKER

    if run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == [RUN_MARKER]:
        (run_dir / RUN_MARKER).unlink()
        run_dir.rmdir()


def claim_recipe_run_dir(recipe: Any, recipe_file: str | Path | None) -> Path:
    """``claim_run_dir`` for the recipe's run directory, kept apart from everything the run reads."""
    return claim_run_dir(recipe.run_dir, run_inputs(recipe, recipe_file))
