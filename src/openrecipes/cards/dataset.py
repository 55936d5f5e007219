"""The rows a card describes: the run's rows manifest, its workflow (SFT, pretraining, LoRA, long context) and the
card's dataset block (source, build, tokenizer, counts), shared by ``card new`` and ``card verify-item``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openrecipes.cards.paths import local_path_text
from openrecipes.config.rundir import rows_directory


def rows_dir_of(recipe: Any, run_dir: Path) -> Path:
    return rows_directory(recipe.data.rows, run_dir)


def read_rows_manifest(rows_dir: Path) -> dict[str, Any]:
    """The rows manifest, after checking that the parquet file is the one it describes."""
    from openrecipes.data.manifest import read_manifest

    return read_manifest(rows_dir, check_parquet=True, require=(
        "name", "rows", "row_tokens", "rows_sha256", "parquet_sha256", "parquet_bytes", "loss_mask"))


ROWS_TEXT = {"sft": "SFT conversations", "pretrain": "pretraining documents", "lora": "SFT conversations (LoRA)",
             "long-context-sft": "long rows of SFT conversations"}
# rows at least this long are long-context SFT on any layout (the seeds' long-context packs: 32,768 and 65,536)
LONG_CONTEXT_ROW_TOKENS = 32768


def card_workflow(recipe: Any, manifest: dict[str, Any]) -> str:
    """The card's workload.workflow: lora when the recipe trains adapters, else what the rows were built for
    (the manifest's workflow; rows built before that field existed are SFT rows); SFT rows split over
    context-parallel ranks (layout.cp > 1) or of at least LONG_CONTEXT_ROW_TOKENS tokens are long-context SFT, as on
    the verification cards."""
    if getattr(recipe, "lora", None) is not None:
        return "lora"
    workflow = str(manifest.get("workflow") or "sft")
    long_rows = int(manifest.get("row_tokens") or 0) >= LONG_CONTEXT_ROW_TOKENS
    return "long-context-sft" if workflow == "sft" and (recipe.layout.cp > 1 or long_rows) else workflow


def _is_bundled(path: str | None, name: str) -> bool:
    from openrecipes.data.bundled import ASSETS

    return path is not None and Path(path).resolve() == (ASSETS / name).resolve()


def _skipped_counts(manifest: dict[str, Any]) -> dict[str, int] | None:
    """The build's skipped conversations by reason (manifest ``invalid_reasons``); entries not of that shape are
    left out here, the card schema judges the rest."""
    reasons = manifest.get("invalid_reasons")
    if not isinstance(reasons, dict):
        return None
    return {str(reason): entry["count"] for reason, entry in reasons.items()
            if isinstance(entry, dict) and "count" in entry} or None


def dataset_block(manifest: dict[str, Any], openrecipes_version: str) -> dict[str, Any]:
    source = manifest.get("source") or {}
    files = source.get("files") or []
    bundled_file = next((name for name in ("conversations.jsonl", "documents.jsonl")
                         if len(files) == 1 and _is_bundled(files[0], name)), None)
    bundled = bundled_file is not None
    what = "documents" if bundled_file == "documents.jsonl" else "conversations"
    tok = manifest.get("tokenizer") or {}
    file_hashes = tok.get("files_sha256") or {}
    hashes = "; ".join(f"{name} sha256 {digest}" for name, digest in sorted(file_hashes.items()))
    if manifest.get("template_sha256") and manifest["template_sha256"] not in file_hashes.values():  # none: pretrain
        hashes += f"; chat template sha256 {manifest.get('template_sha256')}"
    where = "openrecipes bundled tokenizer" if _is_bundled(tok.get("directory"), "tokenizer") else tok.get("directory")
    kwargs = manifest.get("template_kwargs") or {}
    return {
        "name": f"openrecipes bundled {what}" if bundled else str(source.get("description") or manifest["name"]),
        "source": (f"src/openrecipes/data/assets/{bundled_file} of openrecipes {openrecipes_version}"
                   if bundled else ", ".join(map(local_path_text, files)) or str(source.get("description"))),
        "revision": None,
        "license": "synthetic, written for openrecipes (data/assets/LICENSE.txt)" if bundled else None,
        "rows_sha256": manifest["rows_sha256"],
        "build": {
            "name": manifest["name"],
            "tokenizer": f"{where} (vocabulary {tok.get('vocab_size')}; {hashes})",
            "loss_mask": manifest["loss_mask"],
            "rows": manifest["rows"],
            "row_tokens": manifest["row_tokens"],
            "padding_tokens": manifest.get("padding_tokens", 0),
            "seed": manifest.get("seed", 0),
            "packing": manifest.get("packing") or "see docs/data.md",
            "template_kwargs": json.dumps(kwargs, sort_keys=True) if kwargs else None,
            "supervised_token_ratio": manifest.get("supervised_token_ratio"),
            "skipped_invalid": _skipped_counts(manifest),
            "tokens_in_unsupervised_rows": (manifest.get("counts") or {}).get("tokens_in_rows_skipped_unsupervised"),
            "parquet_sha256": manifest["parquet_sha256"],
            "parquet_bytes": manifest["parquet_bytes"],
            "builder": f"openrecipes data build ({manifest.get('format', 'openrecipes rows')})",
        },
    }
