"""A checksum file beside each PEFT adapter the trainer writes, checked before the adapter is merged.

The adapter directory keeps PEFT's own files exactly as PEFT reads them (``adapter_config.json``,
``adapter_model.safetensors``); ``checksums.json`` beside them is the checkpoints' format (``checksums.py``): the size
and sha256 of every other file of the directory. PEFT ignores it. An adapter from elsewhere has none, and then only
its structure is checked (by merge-lora's reader).
"""

from __future__ import annotations

from pathlib import Path

from openrecipes.checkpoint.checksums import CHECKSUMS_FILE, verify_checksums, write_checksums


def forget_adapter_checksums(directory: Path) -> None:
    """Remove the checksums of an adapter about to be rewritten: a write cut short then leaves none (structure is
    still checked) rather than stale ones naming the new files damaged."""
    (directory / CHECKSUMS_FILE).unlink(missing_ok=True)


def write_adapter_checksums(directory: Path) -> None:
    """Hash every file of the adapter directory into its checksum file (after the adapter's last file)."""
    write_checksums(directory, no_dist=True)


def verify_adapter_checksums(directory: str | Path) -> bool:
    """Check the adapter's files against the checksums written with them: a changed, truncated or missing one is a
    one-line ValueError (FileNotFoundError when missing) naming it. False when there are none (an adapter written
    elsewhere)."""
    return verify_checksums(Path(directory), no_dist=True)
