"""Whether a reference run can vouch for a candidate: it must be another run, trained on the same rows.

A run compared with itself (the same directory, or a copy of its metrics) correlates perfectly and would pass the
convergence check whatever it learnt; a reference trained on other rows has another loss curve for reasons that
have nothing to do with the candidate's layout. ``card new`` refuses both before it writes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openrecipes.config.rundir import METRICS_FILE, rows_directory
from openrecipes.utils import sha256_file


def check_reference_run(candidate: Path, reference: Path, *, candidate_rows_sha256: str,
                        reference_recipe: Any) -> None:
    """ValueError naming the problem when ``reference`` cannot serve as ``candidate``'s reference run."""
    from openrecipes.data.manifest import MANIFEST_FILE, read_manifest

    if candidate.resolve() == reference.resolve():
        raise ValueError(f"--reference {reference} is the candidate run itself; a run checked against itself "
                         "always converges: give a separately trained reference run")
    cand_metrics, ref_metrics = candidate / METRICS_FILE, reference / METRICS_FILE
    if cand_metrics.is_file() and ref_metrics.is_file() and sha256_file(cand_metrics) == sha256_file(ref_metrics):
        raise ValueError(f"--reference {reference}: its {METRICS_FILE} is the candidate's, byte for byte (same "
                         "sha256); a copy of the candidate's curve always converges: give a separately trained "
                         "reference run")
    ref_rows = rows_directory(reference_recipe.data.rows, reference)
    ref_sha = read_manifest(ref_rows, require=("rows_sha256",))["rows_sha256"]
    if ref_sha != candidate_rows_sha256:
        raise ValueError(f"--reference {reference} trained on other rows: rows_sha256 {ref_sha} "
                         f"({ref_rows / MANIFEST_FILE}) against the candidate's {candidate_rows_sha256}; a "
                         "convergence check compares runs on the same rows")
