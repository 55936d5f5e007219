"""The package's version, below every layer: run records, checkpoint manifests and ``--version`` read it here."""

__version__ = "0.1.0"
