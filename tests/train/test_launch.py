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
    assert "srun --kill-on-bad-exit=1" in text and "--nproc-per-node=4" in text and "--set layout.dp=8" in text
    assert "sbatch" in capsys.readouterr().out


def test_slurm_script_checks_the_layout_against_the_gpus(tmp_path, capsys):
    assert main(["launch", "slurm", EXAMPLE, "--nodes", "2", "--gpus-per-node", "4",
                 "--out", str(tmp_path / "x.sbatch")]) == 2
    assert "layout" in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()
