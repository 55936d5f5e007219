"""Launching several processes: torchrun on one or more nodes, and an sbatch script for Slurm.

torchrun's agent watches its workers: when one exits with an error the others are stopped and the job ends with
that error, instead of waiting forever in a collective.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from openrecipes.utils import atomic_write_text


def torchrun_command(train_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None) -> list[str]:
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("--rdzv-endpoint HOST:PORT is needed with --nnodes > 1")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=openrecipes"]
    return command + ["-m", "openrecipes", "train", *train_args]


def run_torchrun(train_args: list[str], **kwargs) -> int:
    command = torchrun_command(train_args, **kwargs)
    print("launching: " + shlex.join(command), file=sys.stderr, flush=True)
    command.append("--launch-command=openrecipes " + shlex.join(sys.argv[1:]))
    result = subprocess.run(command)
    if result.returncode:
        print(f"openrecipes train: a worker failed (exit status {result.returncode}); torchrun stopped the others",
              file=sys.stderr)
    return result.returncode


SBATCH_TEMPLATE = """#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --time={time}
#SBATCH --output={log_dir}/%x-%j.out
{extra}
# One torchrun per node; torchrun starts {gpus_per_node} workers and stops them all if one fails.
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node MASTER_PORT={port}
srun --kill-on-bad-exit=1 python -m torch.distributed.run \\
  --nnodes={nodes} --nproc-per-node={gpus_per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$head_node:{port}" --rdzv-id="$SLURM_JOB_ID" \\
  -m openrecipes train {recipe}{overrides}
"""


def write_sbatch(recipe: str, out: Path, *, nodes: int, gpus_per_node: int, overrides: list[str],
                 partition: str | None = None, account: str | None = None, time: str = "04:00:00",
                 cpus_per_task: int = 16, port: int = 29500) -> Path:
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    if not Path(recipe).is_file():
        raise FileNotFoundError(f"recipe {recipe} does not exist")
    extra = "\n".join(f"#SBATCH --{key}={value}" for key, value in (("partition", partition), ("account", account))
                      if value)
    text = SBATCH_TEMPLATE.format(
        job_name=Path(recipe).stem, nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task,
        time=time, log_dir=out.parent.resolve(), extra=extra, port=port, recipe=shlex.quote(str(Path(recipe).resolve())),
        overrides="".join(f" \\\n  --set {shlex.quote(o)}" for o in overrides))
    atomic_write_text(out, text)
    out.chmod(0o755)
    return out


def register(subparsers) -> None:
    slurm_parent = subparsers.add_parser("launch", help="write a job script for a cluster scheduler",
                                         description="Write a job script that runs `openrecipes train` on a cluster.")
    schedulers = slurm_parent.add_subparsers(dest="scheduler", metavar="SCHEDULER", required=True)
    slurm = schedulers.add_parser("slurm", help="an sbatch script: srun starts one torchrun per node",
                                  description="Write an sbatch script (srun + torchrun) and print how to submit it.")
    slurm.add_argument("recipe")
    slurm.add_argument("--nodes", type=int, required=True)
    slurm.add_argument("--gpus-per-node", type=int, required=True)
    slurm.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", default="04:00:00", help="wall-clock limit (default 04:00:00)")
    slurm.add_argument("--out", default=None, help="script path (default: <recipe name>.sbatch)")
    slurm.set_defaults(func=run_slurm)


def run_slurm(args) -> int:
    from pathlib import Path

    from openrecipes.config.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # fail here, not on the cluster, on a bad recipe
    world = args.nodes * args.gpus_per_node
    if recipe.layout.world_size != world:
        raise ValueError(f"layout: tp·pp·cp·dp = {recipe.layout.world_size} but --nodes x --gpus-per-node = {world}")
    out = Path(args.out or f"{Path(args.recipe).stem}.sbatch")
    write_sbatch(args.recipe, out, nodes=args.nodes, gpus_per_node=args.gpus_per_node, overrides=args.overrides,
                 partition=args.partition, account=args.account, time=args.time)
    print(f"wrote {out}\nsubmit it with: sbatch {out}")
    return 0
