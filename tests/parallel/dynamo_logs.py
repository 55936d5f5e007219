"""Dynamo's recompile messages, collected for tests of compiled blocks."""

import contextlib
import logging

import torch


@contextlib.contextmanager
def recompile_reasons():
    """Dynamo's recompile messages ("Recompiling function F in FILE ... triggered by ...") while inside."""
    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    torch._logging.set_logs(recompiles=True)
    logger, handler = logging.getLogger("torch._dynamo.guards.__recompiles"), Collect()
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
