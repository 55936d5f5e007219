"""Launch commands: torchrun arguments and the Slurm script."""

import pytest

from openrecipes.cli import main
from openrecipes.train.launch import torchrun_command

EXAMPLE = "examples/tiny-qwen3-sft.yaml"


def test_single_node_is_standalone():
    command = torchrun_command(["recipe.yaml"], nproc=8)
    assert "--standalone" in command and "--nproc-per-node=8" in command
    assert command[-3:] == ["openrecipes", "train", "recipe.yaml"]


def test_multi_node_needs_a_rendezvous():
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        torchrun_command(["r.yaml"], nproc=8, nnodes=2)
    command = torchrun_command(["r.yaml"], nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="head:29500")
    assert "--nnodes=2" in command and "--node-rank=1" in command and "--rdzv-endpoint=head:29500" in command


def test_slurm_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", EXAMPLE, "--nodes", "2", "--gpus-per-node", "4", "--set", "layout.dp=8",
                 "--partition", "gpu", "--out", str(out)]) == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text and "#SBATCH --partition=gpu" in text
    assert "srun --kill-on-bad-exit=1" in text and "--nproc 4 --nnodes 2" in text and "--set layout.dp=8" in text
    assert '--node-rank "$SLURM_NODEID"' in text and '--rdzv-endpoint "$MASTER_ADDR:29500"' in text
    assert "sbatch" in capsys.readouterr().out


def test_a_cpu_slurm_script_requests_no_gpus(tmp_path):
    out = tmp_path / "cpu.sbatch"
    assert main(["launch", "slurm", EXAMPLE, "--nodes", "1", "--gpus-per-node", "2", "--cpu", "--cpus-per-task", "3",
                 "--port", "31234", "--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert "#SBATCH --gpus-per-node" not in text
    assert "#SBATCH --cpus-per-task=3" in text and "--nproc 2 --nnodes 1" in text and "MASTER_PORT=31234" in text
    assert "--rdzv-endpoint" not in text  # one node: torchrun's standalone rendezvous


def test_slurm_script_checks_the_layout_against_the_gpus(tmp_path, capsys):
    assert main(["launch", "slurm", EXAMPLE, "--nodes", "2", "--gpus-per-node", "4", "--set", "layout.dp=2",
                 "--out", str(tmp_path / "x.sbatch")]) == 2
    assert "layout" in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()


def test_an_impossible_layout_is_refused_before_any_worker_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", EXAMPLE, "--nproc", "2", "--set", "layout.ep=3", "--set", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "openrecipes train: error: layout.ep: ep=3 must divide num_experts=8 (--nproc x --nnodes = 2 processes)"]
    assert not run_dir.exists()  # no rows built, no worker started


def test_an_explicit_dp_is_checked_against_the_processes(tmp_path, capsys):
    assert main(["train", EXAMPLE, "--set", "layout.dp=2", "--set", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "layout.dp: tp·pp·cp·dp = 1·1·1·2 = 2 must equal the world size 1" in capsys.readouterr().err


def test_dp_left_unset_follows_the_world_size():
    from openrecipes.config.layout import LayoutConfig, with_world_size

    assert with_world_size(LayoutConfig(max_tokens_per_gpu=64, tp=2, ep=4), 8).dp == 4
    assert with_world_size(LayoutConfig(max_tokens_per_gpu=64, dp=1), 8).dp == 1  # set: kept, then refused
    assert with_world_size(LayoutConfig(max_tokens_per_gpu=64, tp=3), 8).dp == 1  # 3 does not divide 8


def test_a_failed_worker_is_shown_by_its_own_status_and_message(tmp_path, capsys):
    import os

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from openrecipes.train.launch import record_worker_error, report_failures

    def recorded(name, error):
        os.environ["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / name)
        try:
            record_worker_error(error)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
        return str(tmp_path / name)

    # rank 3 fails first; rank 1 fails within the same second because its peer went away; rank 0 is stopped
    first = recorded("3.json", ValueError("layout.dp: something the worker found"))
    then = recorded("1.json", RuntimeError("Connection closed by peer"))
    failures = {0: ProcessFailure(local_rank=0, pid=12, exitcode=-15, error_file=str(tmp_path / "none.json")),
                1: ProcessFailure(local_rank=1, pid=13, exitcode=1, error_file=then),
                3: ProcessFailure(local_rank=3, pid=11, exitcode=2, error_file=first)}
    assert report_failures(failures) == 2
    assert capsys.readouterr().err.splitlines() == [
        "openrecipes train: rank 3 failed (exit status 2): ValueError: layout.dp: something the worker found",
        "openrecipes train: then rank 1 (exit status 1), rank 0 (signal SIGTERM); torchrun stopped the rest"]


def test_a_worker_the_agent_stopped_comes_after_the_one_that_failed(tmp_path, capsys):
    """Rank 1 aborts without recording anything (a native abort); the agent then stops rank 0, whose SIGTERM
    handler records that signal as its error: rank 1 is still the one that failed."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from openrecipes.train.launch import record_worker_error, report_failures

    os.environ["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / "0.json")
    try:
        record_worker_error(RuntimeError("Signal 15 (SIGTERM) received by PID 12"))
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    failures = {0: ProcessFailure(local_rank=0, pid=12, exitcode=-15, error_file=str(tmp_path / "0.json")),
                1: ProcessFailure(local_rank=1, pid=13, exitcode=-6, error_file=str(tmp_path / "none.json"))}
    assert report_failures(failures) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("openrecipes train: rank 1 failed (signal SIGABRT)"), lines
    assert lines[1] == "openrecipes train: then rank 0 (signal SIGTERM); torchrun stopped the rest"


def test_a_global_batch_the_ranks_cannot_share_is_refused_before_any_worker_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", EXAMPLE, "--nproc", "4", "--set", "global_batch=6", "--set", f"run_dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "openrecipes train: error: layout.dp: dp=4 must divide global_batch=6 (each data-parallel rank takes an "
        "equal share of the rows) (--nproc x --nnodes = 4 processes)"]
    assert not run_dir.exists()  # no rows built, no worker started


def test_slurm_script_refuses_a_recipe_input_missing_here(tmp_path, capsys):
    recipe, out = "examples/qwen3-30b-a3b-8xh200.yaml", tmp_path / "job.sbatch"
    assert main(["launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "8", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"openrecipes launch: error: {recipe}: data.build.input: /path/to/conversations.jsonl does not exist (the job "
        "would read it); give the path as the cluster sees it, e.g. --set data.build.input=PATH"]
    assert not out.exists()
    assert main(["launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "8", "--out", str(out),
                 "--set", "data.build.input=bundled", "--set", "data.build.tokenizer=/path/to/Qwen3"]) == 2
    assert "data.build.tokenizer: /path/to/Qwen3 does not exist" in capsys.readouterr().err
    assert main(["launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "8", "--out", str(out),
                 "--set", "data.build.input=bundled", "--set", "data.build.tokenizer=bundled"]) == 0
    assert out.is_file()
