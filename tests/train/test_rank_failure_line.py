"""The one line `openrecipes measure-rank` (and `tune --screen`) says when a rank's process fails: the cause, not a
wrapper's empty header."""

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
