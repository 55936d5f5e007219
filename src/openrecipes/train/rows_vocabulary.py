"""Rows and model must share a vocabulary: a token id the model's embedding has no row for would fail inside
torch.embedding at step 0 (on a GPU as a device-side assert), so it is refused before, naming the rows and model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openrecipes.config.recipe import Recipe


def check_rows_vocabulary(recipe: Recipe, config: Any, rows: Path, max_token_id: int | None = None) -> None:
    """Refuse rows (the built directory ``rows``) holding ids the model of ``config`` does not have (one line).
    ``max_token_id``: their largest id when the caller already knows it, else read from the rows' manifest (or
    their parquet file, for rows built before manifests recorded it)."""
    from openrecipes.data.manifest import rows_max_token_id

    largest = rows_max_token_id(rows) if max_token_id is None else max_token_id
    vocab_size = int(config.vocab_size)
    if largest < vocab_size:
        return
    field = "data.build.tokenizer" if recipe.data.build is not None else "data.rows"
    # a randomly initialised model takes any vocabulary; a checkpoint's embedding has the rows it was trained with
    bigger = (f", or train a model whose vocabulary holds them (--set model_overrides.vocab_size={largest + 1})"
              if recipe.init == "random" else "")
    raise ValueError(f"{field}: the rows in {rows} use token ids up to {largest:,}; model {recipe.model}'s vocab_size "
                     f"is {vocab_size:,} (ids 0 to {vocab_size - 1:,}): build the rows with the model's "
                     f"tokenizer{bigger}")
