"""The Jinja sandbox chat templates run in, with their work bounded.

A chat template comes with a tokenizer or a ``--chat-template`` file, so it is untrusted code. Jinja's sandbox keeps
it from reaching Python objects, but not from running forever or filling memory: ``range(10**12)`` (its own range
stops at 100,000 items per call, with an OverflowError; nested loops multiply), ``"x" * 10**10``, ``9**9**9``, a
string doubled by ``~`` or ``+`` forty times, ``'x'|center(10**9)`` or ``'%0999999999d' % 1``. Here every rendering
has a budget of loop steps that every ``range()`` draws from; ``*``, ``+``, ``~`` and ``**`` refuse results over a
size limit before building them, and so do the padding of ``%``, ``str.format``, the filters that take a width and
a sum of lists; what is left (memory the machine does not have) is refused as such; and in the main thread a
rendering that runs past ``RENDER_SECONDS`` is stopped (loops over other sequences take no budget). Each bound ends
in one ``chat template:`` ValueError.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import signal
import threading
from contextvars import ContextVar
from typing import Any, Iterator

from jinja2 import pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.nodes import Concat
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


def _too_long(what: str, size: int) -> None:
    if size > MAX_REPEATED_ITEMS:
        raise TemplateBoundError(f"chat template: {what} would build more than {MAX_REPEATED_ITEMS:,} items")


_NUMBER = re.compile(r"\d+")


def _check_widths(what: str, spec: Any) -> None:
    """A format string's widths and precisions (``%0300000000d``, ``{:>300000000}``): each pads to its size."""
    if isinstance(spec, str):
        _too_long(what, max((int(n) for n in _NUMBER.findall(spec)), default=0))


def _bounded_concat(parts: Any) -> str:
    """``~``: the joined length is known before the join is built."""
    texts = [part if isinstance(part, str) else str(part) for part in parts]
    _too_long("'~'", sum(len(text) for text in texts))
    return "".join(texts)


class _BoundedConcatGenerator(CodeGenerator):
    """``~`` through the environment's bounded join (chat templates run without autoescape)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _width_checked(name: str, apply: Any, size: Any) -> Any:
    """Filter ``name`` refused when ``size(value, *args)`` (what it would build) is over the limit."""
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _too_long(f"the {name} filter", size(*args, **kwargs))
        return apply(*args, **kwargs)
    return bounded


def _indent_size(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    text = str(value)
    return len(text) + (width if isinstance(width, int) else len(str(width))) * (text.count("\n") + 1)


def _center_size(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> int:
    return max(len(str(value)), width if isinstance(width, int) else 0)


def _format_size(value: Any, *args: Any, **kwargs: Any) -> int:
    _check_widths("the format filter", value)
    return 0


def _bounded_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum`` filter, with a sum of lists or tuples (``start=[]``) built once, in linear time and within the
    size limit: Python's ``sum`` copies the growing list for every item, one C call the time limit cannot stop."""
    values = list(iterable)
    if attribute is not None:
        getter = make_attrgetter(environment, attribute)
        values = [getter(value) for value in values]
    if isinstance(start, (list, tuple)):
        if not all(type(value) is type(start) for value in values):  # what sum would raise, after its copies
            raise TypeError(f"the sum filter adds {type(start).__name__}s only to {type(start).__name__}s")
        _too_long("the sum filter", len(start) + sum(len(value) for value in values))
        return type(start)(itertools.chain(start, *values))
    return sum(values, start)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with ``*``, ``+``, ``%``, ``**``, ``~``, ``str.format`` and the width-taking filters
    checked before they build anything, and a budgeted ``range``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedConcatGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["range"] = _bounded_range
        self.bounded_concat = _bounded_concat
        for name, size in (("indent", _indent_size), ("center", _center_size), ("format", _format_size)):
            self.filters[name] = _width_checked(name, self.filters[name], size)
        self.filters["sum"] = pass_environment(_bounded_sum)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and _too_big_product(left, right):
            raise TemplateBoundError(f"chat template: '*' would build more than {MAX_REPEATED_ITEMS:,} items")
        if operator == "**" and _too_big_power(left, right):
            raise TemplateBoundError(f"chat template: '**' would build an integer over {MAX_POWER_BITS} bits")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _too_long("'+'", len(left) + len(right))
        if operator == "%":
            _check_widths("'%'", left)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        spec = getattr(value, "__self__", None)

        def checked(*args: Any, **kwargs: Any) -> Any:
            _check_widths("str.format", spec)
            return wrapped(*args, **kwargs)
        return checked


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
    except MemoryError:  # what the bounds above do not foresee, on a machine that cannot hold it
        raise TemplateBoundError("chat template: ran out of memory rendering one conversation") from None
    finally:
        _steps_left.reset(token)
