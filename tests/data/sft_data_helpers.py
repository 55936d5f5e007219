"""Shared helpers of the data tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from openrecipes.config.recipe import DataBuild
from openrecipes.data.build import build
from openrecipes.data.packed import BuildJob
from openrecipes.data.tokenizer import BUNDLED_TOKENIZER

BUNDLED_CONVERSATIONS = BUNDLED_TOKENIZER.parent / "conversations.jsonl"


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_rows(out: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    table = pq.read_table(out / "rows.parquet")
    n = table.num_rows
    return {
        "input_ids": np.array(table.column("input_ids").to_pylist(), dtype=np.int64).reshape(n, -1),
        "loss_mask": np.array(table.column("loss_mask").to_pylist(), dtype=np.int64).reshape(n, -1),
        "doc_lens": table.column("doc_lens").to_pylist(),
    }


JOB_OPTIONS = ("name", "skip_invalid", "overwrite", "progress", "chunk_conversations")


def build_job(out: Path, **options: Any) -> BuildJob:
    """A job of the ``DataBuild`` keys in ``options`` (paths as the recipe writes them) and the rest."""
    spec = {key: str(value) if isinstance(value, Path) else value for key, value in options.items()
            if key not in JOB_OPTIONS}
    return BuildJob(spec=DataBuild(**spec), out=out, **{key: options[key] for key in JOB_OPTIONS if key in options})


def run_build(out: Path, **overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = dict(input=BUNDLED_CONVERSATIONS, tokenizer=BUNDLED_TOKENIZER, loss_mask="qwen3",
                                   row_tokens=256, progress=False, name="test")
    options.update(overrides)
    job = build_job(out, **options)
    return build(job.spec, out, **{key: options[key] for key in JOB_OPTIONS if key in options})


def tokenize_conversations(records: list[dict[str, Any]], tmp_path: Path, tokenizer: Path = BUNDLED_TOKENIZER,
                           loss_mask: str = "qwen3", chat_template: str | None = None,
                           with_separator: bool = False, **reading: Any,
                           ) -> tuple[list[tuple[list[int], np.ndarray]], Any]:
    """(ids, mask) of each record (``{"messages": ..., "tools": ...}``) as the data build makes them, its
    separator removed (kept with ``with_separator``); and the tokenizer bundle. ``reading``: other DataBuild keys
    (input_shape, messages_field, role_map, special_tokens_in_text, template_kwargs)."""
    import types

    from openrecipes.data import build as data_build
    from openrecipes.data.chat_input import Markers
    from openrecipes.data.stream import LimitCounter

    config = build_job(tmp_path / "out", input=Path("unused.jsonl"), tokenizer=tokenizer, loss_mask=loss_mask,
                       row_tokens=64, chat_template=chat_template, progress=False, **reading)
    bundle, renderer, eos_id, _, _ = data_build._prepare(config)
    source = types.SimpleNamespace(where=lambda index: f"conversation {index}",
                                   iter_records=lambda order: ((i, records[i]) for i in order.tolist()))
    markers = Markers.of(bundle, renderer.loss_mask, config.chat_input.special_tokens)  # as the build reads them
    pieces = list(data_build._sft_pieces(config, np.arange(len(records)), source, renderer, bundle.tokenizer, eos_id,
                                         markers, [], [], LimitCounter(max_tokens=None)))
    assert not any(piece.continues for piece in pieces)
    ids, mask = np.concatenate([p.ids for p in pieces]), np.concatenate([p.mask for p in pieces])
    lengths = np.concatenate([p.lengths for p in pieces])
    assert lengths.size == len(records)
    out = []
    bounds = np.cumsum(lengths)[:-1]
    for conv_ids, conv_mask in zip(np.split(ids, bounds), np.split(mask, bounds)):
        assert conv_ids[-1] == eos_id
        if with_separator:
            out.append((conv_ids.tolist(), conv_mask))
            continue
        assert conv_mask[-1] == 0 or renderer.loss_mask.open_end  # only a reply no token of its own closes
        out.append((conv_ids[:-1].tolist(), conv_mask[:-1]))
    return out, bundle
