"""A GPU count past what a plan considers is refused at once, naming the limit; divisors of a count are cheap."""

from __future__ import annotations

import signal
import time

import pytest

from openrecipes.cli import main
from openrecipes.config.hardware import MAX_GPU_COUNT, parse_gpus
from openrecipes.config.layout_space import divisors


@pytest.mark.parametrize("count", ["99999999999", str(MAX_GPU_COUNT + 1), "9" * 5000])
def test_a_count_over_the_limit_is_refused_naming_it(count: str) -> None:
    with pytest.raises(ValueError, match=rf"^--gpus: {count[:20]}(\.\.\.)? GPUs is over the limit of "
                                         rf"{MAX_GPU_COUNT:,} \(MAX_GPU_COUNT\)"):
        parse_gpus(f"{count}xH200")
    assert parse_gpus(f"{MAX_GPU_COUNT}xH200") == (MAX_GPU_COUNT, "H200")


def test_plan_with_a_huge_count_ends_within_a_second(capsys: pytest.CaptureFixture[str]) -> None:
    """It enumerated the divisors of 99,999,999,999 one by one, for minutes."""
    def too_slow(*_: object) -> None:
        raise TimeoutError("plan ran past 5 s")

    assert main(["plan", "qwen3-moe-tiny", "--gpus", "0xH200"]) == 2  # the verb's imports, not counted
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    started = time.monotonic()
    try:
        assert main(["plan", "qwen3-moe-tiny", "--gpus", "99999999999xH200"]) == 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 1.0
    assert f"over the limit of {MAX_GPU_COUNT:,}" in capsys.readouterr().err


def test_divisors_of_a_large_count_are_found_by_pairs() -> None:
    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))
    started = time.monotonic()
    assert divisors(2 ** 40) == [2 ** k for k in range(41)]  # a walk over every number up to it takes hours
    assert time.monotonic() - started < 1.0
