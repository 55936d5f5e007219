"""The Jinja sandbox chat templates run in, with their work bounded.

A chat template comes with a tokenizer or a ``--chat-template`` file, so it is untrusted code. Jinja's sandbox keeps
it from reaching Python objects, but not from running forever or filling memory: ``range(10**12)`` (its own range
stops at 100,000 items per call, with an OverflowError; nested loops multiply), ``"x" * 10**10`` or ``9**9**9``.
Here every rendering has a budget of loop steps that every ``range()`` draws from, ``*`` and ``**`` refuse results
over a size limit, and in the main thread a rendering that runs past ``RENDER_SECONDS`` is stopped (loops over other
sequences take no budget). Each bound ends in one ``chat template:`` ValueError.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from contextvars import ContextVar
from typing import Any, Iterator

from jinja2.sandbox import ImmutableSandboxedEnvironment

# range() items one rendering may use: a real template loops over its messages and tools, a few thousand at most
MAX_RANGE_STEPS = 1_000_000
# the longest string or list `*` may build, and the largest integer `**` may (in bits)
MAX_REPEATED_ITEMS = 1 << 24
MAX_POWER_BITS = 4096
RENDER_SECONDS = 10.0

_steps_left: ContextVar[list[int] | None] = ContextVar("template_steps_left", default=None)


class TemplateBoundError(ValueError):
    """A chat template went past one of this module's bounds."""


def _spend(steps: int) -> None:
    left = _steps_left.get()
    if left is None:  # rendered outside ``bounded_render``: the bound holds per call
        left = [MAX_RANGE_STEPS]
    if steps > left[0]:
        raise TemplateBoundError(f"chat template: range() would loop more than {MAX_RANGE_STEPS:,} times in one "
                                 "rendering")
    left[0] -= steps


def _bounded_range(*args: Any) -> range:
    items = range(*args)
    try:
        size = len(items)
    except OverflowError:  # more items than a Python size holds
        size = MAX_RANGE_STEPS + 1
    _spend(size)
    return items


def _too_big_product(left: Any, right: Any) -> bool:
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
            return len(sequence) * count > MAX_REPEATED_ITEMS
    return False


def _too_big_power(base: Any, exponent: Any) -> bool:
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0 or abs(base) <= 1:
        return False
    return exponent * math.log2(abs(base)) > MAX_POWER_BITS


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with ``*`` and ``**`` checked before they run and a budgeted ``range``."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and _too_big_product(left, right):
            raise TemplateBoundError(f"chat template: '*' would build more than {MAX_REPEATED_ITEMS:,} items")
        if operator == "**" and _too_big_power(left, right):
            raise TemplateBoundError(f"chat template: '**' would build an integer over {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the block with a TemplateBoundError after ``seconds`` (the main thread only, and only when no other
    real-time timer is set: a signal handler belongs to the main thread, and another timer is not ours to move)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise TemplateBoundError(f"chat template: rendering one conversation took more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bounded_render(template: Any, **variables: Any) -> str:
    """``template.render(**variables)`` within the bounds above; a template that recurses without end is refused."""
    token = _steps_left.set([MAX_RANGE_STEPS])
    try:
        with _time_limit(RENDER_SECONDS):
            return template.render(**variables)
    except RecursionError:
        raise TemplateBoundError("chat template: calls itself too deeply (a macro that never stops)") from None
    except OverflowError as error:  # arithmetic past a float's range and the like
        raise TemplateBoundError(f"chat template: {error}") from None
    finally:
        _steps_left.reset(token)
