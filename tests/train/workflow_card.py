"""`openrecipes card new` for a workflow test's two runs: the resumed run as the candidate, the uninterrupted one as
its reference (same rows, same losses), written under a catalog so the site can be built from the cards."""

from __future__ import annotations

from pathlib import Path

from openrecipes.cards.validate import LoadedCard, load_card
from openrecipes.cli import main


def workflow_card(candidate: Path, reference: Path, catalog: Path, window: tuple[int, int]) -> LoadedCard:
    """Write the card of ``candidate`` to ``catalog``/qwen3-moe-tiny/cpu/RUN.yaml; it must validate."""
    out = catalog / "qwen3-moe-tiny" / "cpu" / f"{candidate.parent.name}.yaml"
    code = main(["card", "new", str(candidate), "--reference", str(reference), "--out", str(out),
                 "--author", "openrecipes tests", "--window", *map(str, window), "--gpu-memory-gb", "16"])
    loaded = load_card(out)
    assert code == 0 and loaded.ok, [str(p) for p in loaded.problems]
    assert loaded.card.correctness.convergence.result == "pass"  # the resumed run's losses are the reference's
    return loaded
