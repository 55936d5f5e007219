"""A recipe's ``epochs`` (Hugging Face's ``num_train_epochs``): passes over the rows, turned into ``steps`` when the
recipe is loaded, so everything downstream (schedule, resume, cards, the tuner) still counts optimizer steps and the
run directory's recipe.yaml records the steps (and ``epochs: null``). A recipe gives one of the two: both is an error
rather than one silently winning (``--set steps=N`` on a recipe of epochs, or ``--set epochs=N`` on a resumed run,
which recorded its steps, names the other to clear)."""

from __future__ import annotations

import math
from typing import Any


# the most optimizer steps a recipe may ask for (a billion: years of steps on any fleet), so a mistyped count is
# refused instead of a run that never ends
MAX_STEPS = 10**9


def steps_of_epochs(epochs: float, *, rows: int, global_batch: int) -> int:
    """Whole optimizer steps of ``global_batch`` rows in ``epochs`` passes over ``rows`` rows (at least one): rounded
    down, so no row is trained on more than ``epochs`` times (the rows of an incomplete last batch wait, as with a
    data loader's drop_last)."""
    steps = epochs * rows / global_batch + 1e-9  # 1e-9: 0.3 * 10 / 3 is 0.9999...
    if not steps <= MAX_STEPS:  # inf included
        raise ValueError(f"epochs {epochs!r}: {rows} rows in batches of {global_batch} make more than {MAX_STEPS:,} "
                         "steps")
    return max(1, math.floor(steps))


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def epochs_into_steps(tree: Any) -> Any:
    """The recipe mapping ``tree`` with its ``epochs`` replaced by the ``steps`` they make (a copy), or ``tree`` itself
    where there is nothing to resolve (no epochs, or a value the field checks will refuse)."""
    if not isinstance(tree, dict) or tree.get("epochs") is None:
        return tree
    epochs, global_batch = tree["epochs"], tree.get("global_batch")
    if tree.get("steps") is not None:
        raise ValueError(f"give steps or epochs, not both (steps {tree['steps']!r}, epochs {epochs!r}): "
                         "--set steps=null trains the epochs, --set epochs=null the steps")
    if not _positive_number(epochs) or not (isinstance(global_batch, int) and _positive_number(global_batch)):
        return tree
    data = tree.get("data")
    build = data.get("build") if isinstance(data, dict) else None
    rows = build.get("rows") if isinstance(build, dict) else None
    if not (isinstance(rows, int) and _positive_number(rows)):
        raise ValueError("epochs needs the number of rows, data.build.rows (a built data.rows directory or a build "
                         "of all its input has no count here): give data.build.rows, or steps (rows / global_batch "
                         "steps is one epoch)")
    resolved = {key: value for key, value in tree.items() if key != "epochs"}
    resolved["steps"] = steps_of_epochs(epochs, rows=rows, global_batch=global_batch)
    return resolved
