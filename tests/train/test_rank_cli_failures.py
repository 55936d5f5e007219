"""When a rank's process fails: the one line `openrecipes measure-rank` (and `tune --screen`) says is the cause, not a
wrapper's empty header, and the ranks measured before or after it are still reported."""

from openrecipes.train.rank_cli import failure_line

# the shape of what torch's pipeline schedule prints when a stage's backward runs out of memory on a CUDA device
PIPELINE_OOM = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "stage.py", line 614, in <lambda>
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.08 GiB. GPU 0 has a total capacity of 79.18 GiB
[rank0]:
[rank0]: The above exception was the direct cause of the following exception:
[rank0]:
[rank0]:   File "_backward.py", line 411, in stage_backward
[rank0]:     raise RuntimeError(exc_msg) from e
[rank0]: RuntimeError:
[rank0]:         Failed to run stage backward:
[rank0]:         Stage output: ('Tensor(torch.Size([1, 2048, 8192]), grad=True, dtype=torch.bfloat16)',)
"""


def test_a_wrapper_without_a_message_gives_way_to_its_cause():
    assert failure_line(PIPELINE_OOM).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")


def test_the_last_exception_with_a_message_is_the_line():
    text = "ValueError: first\nwarning: noise\nKeyError: 'second'\nsome trailing line\n"
    assert failure_line(text) == "KeyError: 'second'"
    assert failure_line("RuntimeError:\n") == "RuntimeError:"
    assert failure_line("only a line\n\n") == "only a line"
    assert failure_line("") == "(no message)"


def test_a_rank_that_fails_leaves_the_measured_ones_reported(tmp_path, monkeypatch, capsys):
    """One rank's process failing (out of memory, say) still prints the ranks measured, then ends with an error
    naming how many were not."""
    import argparse
    import json
    from pathlib import Path

    import pytest

    from openrecipes.train import rank_cli

    def fake_measure(recipe, rank, world, out, *, steps, overrides=(), timeout_s=None):
        if rank == 0:
            raise ValueError(f"rank {rank}: the measuring process failed: torch.OutOfMemoryError: CUDA out of memory")
        return {"rank": rank, "pp_rank": 1, "microbatches": 2, "parameters": {"dense": 1, "experts": 2},
                "phases_s": {"forward_backward": 0.5, "optimizer": 0.1}, "peak_rss_gib": 0.5}

    monkeypatch.setattr(rank_cli, "measure_in_process", fake_measure)
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"
    args = argparse.Namespace(recipe=str(example), overrides=["layout.pp=2"], gpus="2xH100", ranks="0,1", steps=2,
                              out=tmp_path / "ranks", json=True)
    with pytest.raises(ValueError, match=r"^1 of 2 ranks not measured: rank 0: .*OutOfMemoryError"):
        rank_cli.run(args)
    printed = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in printed["ranks"]] == [1] and printed["ranks"][0]["predicted"]["compute_s"] > 0
    assert printed["failed"] == [{"rank": 0, "error": "rank 0: the measuring process failed: "
                                                      "torch.OutOfMemoryError: CUDA out of memory"}]


def test_the_output_directory_is_one_measure_rank_made(tmp_path, monkeypatch):
    """--out: a directory of files measure-rank did not write, or a file, is refused before anything is written
    there; a directory it made is written into again."""
    import argparse
    from pathlib import Path

    import pytest

    from openrecipes.train import rank_cli

    monkeypatch.setattr(rank_cli, "measure_in_process", lambda recipe, rank, world, out, **kw: {
        "rank": rank, "pp_rank": 0, "microbatches": 1, "parameters": {"dense": 1, "experts": 2},
        "phases_s": {"forward_backward": 0.5, "optimizer": 0.1}, "peak_rss_gib": 0.5})
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-sft.yaml"

    def run(out, steps=2):
        rank_cli.run(argparse.Namespace(recipe=str(example), overrides=["layout.dp=2"], gpus="2xH100", ranks="0",
                                        steps=steps, out=out, json=True))

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "rank-0.json").write_text('{"mine": 1}')
    with pytest.raises(ValueError, match=r"^--out: .* was not written by openrecipes measure-rank"):
        run(foreign)
    assert [p.name for p in foreign.iterdir()] == ["rank-0.json"] and "mine" in (foreign / "rank-0.json").read_text()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"^--out: .* is not a directory"):
        run(tmp_path / "a-file")
    run(tmp_path / "ours")
    run(tmp_path / "ours")  # its own directory: written again
    assert (tmp_path / "ours" / rank_cli.RANKS_MARKER).is_file()
    with pytest.raises(ValueError, match=r"^--steps: must be at least 2 \(the first is a warm-up"):
        run(tmp_path / "ours", steps=1)
