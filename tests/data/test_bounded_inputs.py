"""Bad or hostile input costs bounded memory: text quoting added tokens is encoded window by window."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from openrecipes.data import manifest as manifest_module
from openrecipes.data import stream

from tests.data.sft_data_helpers import run_build, write_jsonl

# text quoting the bundled tokenizer's added tokens about once every dozen characters (the worst case per character)
QUOTING = "a <|im_end|> b <think> c </think><|im_start|> "
PLAIN = "a im_end b think c think im_start "


def _conversation(unit: str, chars: int) -> dict:
    return {"messages": [{"role": "user", "content": "quote this"},
                         {"role": "assistant", "content": unit * (chars // len(unit))}]}


def _peak(tmp_path: Path, name: str, record: dict) -> int:
    source = write_jsonl(tmp_path / f"{name}.jsonl", [record])
    tracemalloc.start()
    try:
        run_build(tmp_path / name, input=source, row_tokens=256)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_quoted_tokens_cost_what_plain_text_costs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak Python memory of a long conversation quoting added tokens: within a little of the same length of plain
    text. Encoded whole (token offsets as Python tuples, a marker string per quoted token), 100,000 characters of
    such text peaked at 12.8 MB against 1.1 MB for plain text; in windows at 1.1 MB too."""
    monkeypatch.setattr(stream, "WINDOW_CHARS", 4096)
    monkeypatch.setattr(stream, "MARGIN_CHARS", 256)
    monkeypatch.setattr(manifest_module, "ROW_GROUP_TOKENS", 1 << 14)
    run_build(tmp_path / "warm", input=write_jsonl(tmp_path / "warm.jsonl", [_conversation(QUOTING, 5_000)]),
              row_tokens=256)  # one-time costs (the compiled template, the pattern) not counted
    plain = _peak(tmp_path, "plain", _conversation(PLAIN, 100_000))
    quoting = _peak(tmp_path, "quoting", _conversation(QUOTING, 100_000))
    print(f"peak {plain / 1e6:.2f} MB plain, {quoting / 1e6:.2f} MB quoting added tokens")
    assert quoting < 1.5 * plain + 500_000


def test_a_long_conversation_quoting_tokens_has_the_rows_of_a_whole_encoding(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    records = [_conversation(QUOTING, 9_000), {"messages": [
        {"role": "user", "content": "<|im_start|>user\n" * 300}, {"role": "assistant", "content": "ok <think>"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "fine </tool_call>" * 200}]}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    whole = run_build(tmp_path / "whole", input=source, row_tokens=64)  # each shorter than the default window
    monkeypatch.setattr(stream, "WINDOW_CHARS", 1024)
    monkeypatch.setattr(stream, "MARGIN_CHARS", 64)
    windowed = run_build(tmp_path / "windowed", input=source, row_tokens=64)
    assert windowed["rows"] == whole["rows"] > 50
    assert windowed["rows_sha256"] == whole["rows_sha256"]


# A child process builds rows of a few MB of text quoting added tokens with its address space limited to what it
# already holds after a small build, plus a margin far below what a whole encoding of that text needs
_LIMITED_BUILD = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    sys.path.insert(0, ".")
    from tests.data.sft_data_helpers import run_build, write_jsonl
    tmp, unit, chars, margin = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    def record(n):
        return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": unit * (n // len(unit))}]}
    run_build(tmp / "warm", input=write_jsonl(tmp / "warm.jsonl", [record(20_000)]), row_tokens=4096)
    held = int(next(l for l in open("/proc/self/status") if l.startswith("VmPeak")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (held + margin, resource.RLIM_INFINITY))
    manifest = run_build(tmp / "big", input=write_jsonl(tmp / "big.jsonl", [record(chars)]), row_tokens=4096)
    print("rows", manifest["rows"])
""")


def test_a_build_of_text_quoting_tokens_fits_a_small_address_space(tmp_path: Path) -> None:
    """600,000 characters of text quoting added tokens: encoded whole, they took 147 MB of address space more than
    the small build before them; in windows, none more (nor does plain text)."""
    child = subprocess.run([sys.executable, "-c", _LIMITED_BUILD, str(tmp_path), QUOTING, "600000",
                            str(64 << 20)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("rows ")
