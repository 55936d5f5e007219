"""Bad or hostile input costs bounded memory: text quoting added tokens is encoded window by window."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from openrecipes.data import manifest as manifest_module
from openrecipes.data import stream

from tests.data.sft_data_helpers import run_build, write_jsonl

# text quoting the bundled tokenizer's added tokens about once every dozen characters (the worst case per character)
# tokens a reply may only quote as text (its own <think>/<tool_call> markers keep their ids: test_added_tokens.py)
QUOTING = "a <|im_end|> b <tool_response> c </tool_response><|im_start|> "
PLAIN = "a im_end b tool_response c tool_response im_start "


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


def _image_build(tmp_path: Path, image: str) -> dict:
    from openrecipes.data import bundled

    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": image}]},
                           {"role": "assistant", "content": "ok"}]}
    return run_build(tmp_path / "out", input=write_jsonl(tmp_path / "chat.jsonl", [record]), row_tokens=16,
                     tokenizer=bundled.VL_TOKENIZER, image_processor=bundled.IMAGE_PROCESSOR)


@pytest.mark.parametrize("case", ["fifo", "/dev/zero", "/dev/urandom", "directory"])
def test_an_image_path_that_is_not_a_regular_file_is_refused_unread(tmp_path: Path, case: str) -> None:
    """A FIFO would hang the build waiting for a writer; /dev/zero and /dev/urandom were read until memory ran out."""
    pytest.importorskip("PIL.Image")
    done = threading.Event()
    if case == "fifo":
        os.mkfifo(tmp_path / "pipe.png")
        case = str(tmp_path / "pipe.png")
        # a reader blocked on the FIFO is let go after a few seconds (an empty file), so a build that waits fails
        threading.Thread(target=_release_readers, args=(case, done), daemon=True).start()
    elif case == "directory":
        (tmp_path / "folder.png").mkdir()
        case = str(tmp_path / "folder.png")
    if not os.path.exists(case):
        pytest.skip(f"{case} does not exist here")
    try:
        with pytest.raises(ValueError, match=rf"chat.jsonl line 1: image {re.escape(case)} is not a regular file "
                                             r"\(a directory, FIFO, socket or device\); only image files are read$"):
            _image_build(tmp_path, case)
    finally:
        done.set()


def _release_readers(fifo: str, done: threading.Event) -> None:
    deadline = time.monotonic() + 3
    while not done.wait(0.05) and time.monotonic() < deadline:
        pass
    while not done.is_set():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader (ENXIO)
            done.wait(0.05)


def test_an_image_file_over_the_byte_limit_is_refused_unread(tmp_path: Path) -> None:
    """A sparse 3 GB file (no disk used): read whole, it took 3 GB of memory before Pillow refused it."""
    pytest.importorskip("PIL.Image")
    from openrecipes.data.image_rows import MAX_IMAGE_BYTES

    big = tmp_path / "big.png"
    with open(big, "wb") as handle:
        handle.truncate(3 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"image {re.escape(str(big))} is 3,221,225,472 bytes, over the "
                                             f"{MAX_IMAGE_BYTES:,}-byte limit"):
            _image_build(tmp_path, str(big))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("where", ["input", "dataset directory"])
def test_an_input_that_is_a_fifo_is_refused_unread(tmp_path: Path, where: str) -> None:
    """A FIFO as the input, or among a dataset directory's files, waited for a writer (or was called not found)."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    fifo = folder / "part-1.jsonl" if where == "dataset directory" else tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    done = threading.Event()
    threading.Thread(target=_release_readers, args=(str(fifo), done), daemon=True).start()
    try:
        with pytest.raises(ValueError, match=rf"^{re.escape(str(fifo))}: not a regular file \(a FIFO, socket, device "
                                             r"or directory\); inputs are read from files$"):
            run_build(tmp_path / "out", input=folder if where == "dataset directory" else fifo)
    finally:
        done.set()
