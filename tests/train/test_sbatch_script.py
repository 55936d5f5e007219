"""The sbatch script as data: values that could end a line of it are refused naming their flag or file, Slurm names
and times must read as such, job names are plain and unique, a job's state is read from squeue's fields only, and
`launch slurm` refuses every recipe `train` refuses. No cluster needed (tests/train/test_slurm_hostile.py submits)."""

from __future__ import annotations

import re

import pytest

from openrecipes.cli import main
from openrecipes.train.sbatch import new_identity, write_sbatch
from openrecipes.train.slurm import UNKNOWN, parse_state

EXAMPLE = "examples/tiny-qwen3-sft.yaml"
CONTROL = ["\n", "\r", "\x00", "\t", "\x1b", "\x7f"]


def _launch(tmp_path, recipe=EXAMPLE, *extra: str, out=None) -> list[str]:
    return ["launch", "slurm", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--cpu",
            "--out", str(out or tmp_path / "job.sbatch"), *extra]


def _one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(text in err[0] for text in expected), err
    return err[0]


@pytest.mark.parametrize("char", CONTROL)
@pytest.mark.parametrize("flag", ["--partition", "--account", "--time", "--set"])
def test_a_control_character_in_a_flag_is_refused_naming_it(tmp_path, capsys, flag, char):
    value = {"--set": f"steps=2{char}touch pwned"}.get(flag, f"ci{char}touch pwned")
    assert main(_launch(tmp_path, EXAMPLE, flag, value)) == 2
    _one_line_error(capsys, f"{flag}: ")
    assert not (tmp_path / "job.sbatch").exists() and not list(tmp_path.rglob("pwned"))


@pytest.mark.parametrize("char", [c for c in CONTROL if c != "\x00"])  # no file name holds a NUL
def test_a_control_character_in_a_file_or_folder_name_is_refused_naming_it(tmp_path, capsys, char):
    recipe = tmp_path / f"x{char}touch pwned{char}#.yaml"
    recipe.write_text(open(EXAMPLE).read())
    assert main(_launch(tmp_path, recipe)) == 2
    _one_line_error(capsys, "recipe file name: ")
    folder = tmp_path / f"out{char}touch pwned"
    folder.mkdir()
    assert main(_launch(tmp_path, EXAMPLE, out=folder / "job.sbatch")) == 2
    _one_line_error(capsys, "--out: ")
    assert not list(tmp_path.rglob("*.sbatch"))


@pytest.mark.parametrize("flag, value", [("--partition", "gpu debug"), ("--partition", "gpu;touch x"),
                                         ("--account", "$(whoami)"), ("--account", "a`b`"),
                                         ("--time", "soon"), ("--time", "1:00 --wrap=x"), ("--time", "")])
def test_slurm_names_and_times_must_read_as_such(tmp_path, capsys, flag, value):
    assert main(_launch(tmp_path, EXAMPLE, flag, value)) == 2
    _one_line_error(capsys, f"{flag}: ")


@pytest.mark.parametrize("time", ["90", "30:00", "04:00:00", "2-00", "1-12:30", "1-00:00:00", "UNLIMITED"])
def test_every_slurm_time_format_is_accepted(tmp_path, time):
    assert main(_launch(tmp_path, EXAMPLE, "--time", time)) == 0
    assert f"#SBATCH --time={time}\n" in (tmp_path / "job.sbatch").read_text()


def test_a_hostile_folder_and_recipe_name_stay_data_in_the_script(tmp_path):
    folder = tmp_path / 'w JobState=COMPLETED ExitCode=0:0 $(touch pwned) `touch pwned` "q" \'s\' %j #c'
    folder.mkdir()
    recipe = folder / "r $(touch pwned);x %x #.yaml"
    recipe.write_text(open(EXAMPLE).read())
    script = write_sbatch(str(recipe), folder / "a b.sbatch", nodes=2, gpus_per_node=1, overrides=["steps=$(id)"])
    lines = script.path.read_text().splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    # every directive before the first command, one option each, the output in double quotes with % doubled
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(lines.index(line) < first_command for line in directives)
    assert f'#SBATCH --output="{str(folder).replace("%", "%%").replace(chr(34), chr(92) + chr(34))}/%x-%j.out"' \
        in directives
    assert re.fullmatch(r"#SBATCH --job-name=openrecipes-r_touch_pwned_x_x-[0-9a-f]{8}", directives[0])
    assert script.identity.script == str((folder / "a b.sbatch").resolve())
    assert "'steps=$(id)'" in script.path.read_text()  # the --set value single-quoted for bash
    assert not list(tmp_path.rglob("pwned"))


def test_job_names_are_plain_and_unique(tmp_path):
    names = {new_identity("x y/..$(z)", tmp_path / "a.sbatch").name for _ in range(20)}
    assert len(names) == 20 and all(re.fullmatch(r"openrecipes-x_y_\.\._z-[0-9a-f]{8}", name) for name in names)
    assert new_identity("...", tmp_path / "a.sbatch").name.startswith("openrecipes-recipe-")


@pytest.mark.parametrize("answer, expected", [
    ("12|FAILED|768|NonZeroExitCode|\n", ("FAILED", 3, 0, "NonZeroExitCode")),
    ("12|COMPLETED|0|None|\n", ("COMPLETED", 0, 0, "None")),
    ("12|CANCELLED|15|None|\n", ("CANCELLED", 0, 15, "None")),
    ("12|OUT_OF_MEMORY|125|OutOfMemory|\n", ("OUT_OF_MEMORY", 0, 125, "OutOfMemory")),
    ("12|PENDING|0|a reason | with bars|\n", ("PENDING", 0, 0, "a reason | with bars")),
])
def test_a_state_is_read_from_squeues_fields(answer, expected):
    state = parse_state("12", answer)
    assert (state.state, state.exit_code, state.signal, state.reason) == expected


@pytest.mark.parametrize("answer", [
    "JobId=12 JobName=x JobState=COMPLETED ExitCode=0:0\n",  # scontrol's free text is never read
    "13|COMPLETED|0|None|\n",  # another job's line
    "12|completed JobState=COMPLETED|0|None|\n", "12|COMPLETED|0:0|None|\n", "12|COMPLETED\n", "",
])
def test_an_answer_that_does_not_read_as_fields_is_unknown_never_completed(answer):
    state = parse_state("12", answer)
    assert state.state == UNKNOWN and not state.final and not state.completed


# Recipes `openrecipes train` refuses before starting a process (each case is also in the tests of train's own
# checks: tests/train/test_recipe.py, tests/test_hostile_inputs.py, tests/train/test_launch.py); `launch slurm` must
# refuse each with the same message, before writing a script. A missing input is the one message of its own: the
# login node says the job would read a path that does not exist, and how to give the cluster's.
TRAIN_REFUSALS = [
    (["model_overrides.num_hidden_layers=0"], "num_hidden_layers"),
    (["model_overrides.num_hidden_layers=-2"], "num_hidden_layers"),
    (["model_overrides.no_such_field=1"], "no_such_field"),
    (["model_overrides.rope_theta=.inf"], "rope_theta: not a finite number"),
    (["model_overrides.rope_theta=1.0e+400"], "rope_theta: not a finite number"),
    (["recompute={granularity: full, method: block, num_layers: 99}"], "recompute.num_layers=99"),
    (["layout.ep=3"], "layout.ep: ep=3 must divide num_experts=8"),
    (["steps=0"], "steps"),
    (["optimzer.lr=1e-3"], "did you mean 'optimizer'"),
    (["offload.fraction=2"], "offload.fraction"),
    (["layout.tp=0"], "layout.tp"),
    (["data.rows=/no/such/rows", "data.build=null"], "/no/such/rows"),
]


@pytest.mark.parametrize("sets, names", TRAIN_REFUSALS)
def test_launch_slurm_refuses_what_train_refuses(tmp_path, capsys, sets, names):
    overrides = [arg for item in sets for arg in ("--set", item)]
    assert main(["train", EXAMPLE, *overrides, "--set", f"run_dir={tmp_path / 'run'}"]) == 2
    train_error = _one_line_error(capsys, names).removeprefix("openrecipes train: error: ")
    assert main(_launch(tmp_path, EXAMPLE, *overrides)) == 2
    launch_error = _one_line_error(capsys, names).removeprefix("openrecipes launch: error: ")
    if "does not exist (the job would read it)" not in launch_error:
        assert launch_error.replace("--nodes x --gpus-per-node", "--nproc x --nnodes") == train_error
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "run").exists()
