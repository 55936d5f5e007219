"""The sbatch script of a training run (``openrecipes launch slurm``) and of a tuner's trial: one writer, so that no
value reaches the job as code.

Every value written into the script is checked first: a control character (newline, carriage return, NUL, ...)
would end a ``#SBATCH`` line or a quoted word and start a command, so it is refused with one line naming the flag or
file. Slurm names (partition, account) and the time limit must read as such. Paths in the script body are
``shlex``-quoted; the output path in its ``#SBATCH`` line is in sbatch's double quotes, with ``%`` doubled for
Slurm's file name patterns (a folder named ``o%j`` stays ``o%j``). The job name is not the recipe's file name but a
name made of it (letters, digits, ``.``, ``_``, ``-`` only) and a random token: with the user and the script's path
it is the job's identity (``slurm.JobIdentity``), checked before a job is followed again or cancelled.
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from openrecipes.config.rundir import RECIPE_FILE
from openrecipes.train.slurm import JobIdentity, current_user
from openrecipes.utils import atomic_write_text, check_output_file

# the script's second line: a file without it is not replaced (it is not a script this tool wrote)
SBATCH_MARK = "# written by openrecipes launch slurm; rerunning it may replace this file"
JOB_NAME_PREFIX = "openrecipes-"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*")  # a partition, an account, or a list of them
# minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds
_SLURM_TIME = re.compile(r"(?:\d+-\d+(?::\d+){0,2}|\d+(?::\d+){0,2}|unlimited|infinite)", re.IGNORECASE)
_BODY = """\
# One `openrecipes train` per node, as on a single machine: the first node's checks the recipe, builds data.build's
# rows and holds the run directory before its torchrun starts; each node's torchrun starts {gpus_per_node} workers
# and stops them all if one fails. The node's rank is read inside each task (srun sets SLURM_NODEID per node).
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# the address Slurm reaches the first node at (its NodeAddr): a node name DNS may not know, several nodes on one host
head_addr=$(sinfo -h -N -n "$head_node" -o %o | head -n 1)
export MASTER_ADDR=${{head_addr:-$head_node}} MASTER_PORT={port}
srun --kill-on-bad-exit=1 bash -c 'exec python -m openrecipes train "$@" --node-rank "$SLURM_NODEID"' train \\
  {what} --nproc {gpus_per_node} --nnodes {nodes}{rendezvous}{overrides}
"""


def plain_value(option: str, value: str) -> str:
    """``value`` unchanged if it holds no control character (which could end a line of the script)."""
    if _CONTROL.search(value):
        raise ValueError(f"{option}: {value!r} holds a control character (newline, carriage return, tab, NUL, ...), "
                         "which could end a line of the job script; rename it")
    return value


def slurm_names(option: str, value: str) -> str:
    if not _SLURM_NAMES.fullmatch(plain_value(option, value)):
        raise ValueError(f"{option}: {value!r} is not a Slurm name (letters, digits, '_', '.', '+', '-'; a list "
                         "separated by commas)")
    return value


def slurm_time(value: str) -> str:
    if not _SLURM_TIME.fullmatch(plain_value("--time", value)):
        raise ValueError(f"--time: {value!r} is not a Slurm time (minutes, hours:minutes:seconds, "
                         "days-hours:minutes:seconds, ...)")
    return value


def slurm_filename(option: str, path: Path) -> str:
    """``path`` for sbatch's --output: ``%`` doubled, so that Slurm's file name patterns leave it as written. A
    backslash would turn the patterns off (and a control character end the line): refused."""
    text = plain_value(option, str(path))
    if "\\" in text:
        raise ValueError(f"{option}: {text!r} holds a backslash, which Slurm's file name patterns read as an escape")
    return text.replace("%", "%%")


def check_script_values(*, recipe: str | None, resume: str | None, out: str | Path | None, overrides: list[str],
                        partition: str | None, account: str | None, time: str) -> None:
    """Refuse, naming its flag or file, any value the script would hold that could end one of its lines or is not
    what Slurm reads there: before a recipe is loaded or a file written."""
    for option, value in (("recipe file name", recipe), ("--resume", resume), ("--out", out),
                          *(("--set", item) for item in overrides)):
        if value is not None:
            plain_value(option, str(value))
    for option, value in (("--partition", partition), ("--account", account)):
        if value is not None:
            slurm_names(option, value)
    slurm_time(time)


def _sbatch_quoted(value: str) -> str:
    """A word of an #SBATCH line as sbatch reads it: in double quotes, a double quote or backslash escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def new_identity(stem: str, script: Path) -> JobIdentity:
    """A job name unique to this script: ``openrecipes-<the recipe's name, plain characters only>-<random token>``."""
    plain = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:48] or "recipe"
    return JobIdentity(name=f"{JOB_NAME_PREFIX}{plain}-{secrets.token_hex(4)}", user=current_user(),
                       script=str(script.resolve()))


@dataclass(frozen=True)
class SbatchScript:
    path: Path
    identity: JobIdentity  # the job's name, user and script path
    output_dir: Path  # the job's output: output_dir / "<job name>-<job id>.out"

    def output_args(self) -> tuple[str, ...]:
        """sbatch's --output as an argument (over any SBATCH_OUTPUT of the environment, as in the script)."""
        return ("--output", slurm_filename("--out", self.output_dir) + "/%x-%j.out")


def write_sbatch(recipe: str | None, out: Path, *, nodes: int, gpus_per_node: int, overrides: list[str],
                 resume: str | None = None, partition: str | None = None, account: str | None = None,
                 time: str = "04:00:00", cpus_per_task: int = 16, port: int = 29500, cpu: bool = False) -> SbatchScript:
    """Write the job script of ``recipe`` (or of the run ``resume`` continues); ``cpu``: request no GPUs (the
    workers, ``gpus_per_node`` of them, run on CPU). The job is not requeued after a node failure: it ends NODE_FAIL
    and ``--resume`` continues it from its last checkpoint."""
    if nodes < 1 or gpus_per_node < 1 or cpus_per_task < 1:
        raise ValueError(f"--nodes, --gpus-per-node and --cpus-per-task must be >= 1, got {nodes}, {gpus_per_node} "
                         f"and {cpus_per_task}")
    if not 0 < port < 65536:
        raise ValueError(f"--port: {port} is not a TCP port")
    if (recipe is None) == (resume is None):
        raise ValueError("give either RECIPE or --resume RUN_DIR")
    check_script_values(recipe=recipe, resume=resume, out=out, overrides=overrides, partition=partition,
                        account=account, time=time)
    source = Path(str(recipe or resume)).resolve()
    if not (source.is_dir() if resume else source.is_file()):
        raise FileNotFoundError(f"{'run directory' if resume else 'recipe'} {recipe or resume} does not exist")
    out = Path(out)
    _check_script_out(out, recipe or source / RECIPE_FILE)
    script = SbatchScript(path=out, identity=new_identity(source.stem, out), output_dir=out.parent.resolve())
    options = [f"--job-name={script.identity.name}", f"--nodes={nodes}", "--ntasks-per-node=1", "--no-requeue",
               *([] if cpu else [f"--gpus-per-node={gpus_per_node}"]), f"--cpus-per-task={cpus_per_task}",
               f"--time={time}", f"--output={_sbatch_quoted(script.output_args()[1])}",
               *(f"--{key}={value}" for key, value in (("partition", partition), ("account", account)) if value)]
    body = _BODY.format(
        gpus_per_node=gpus_per_node, nodes=nodes, port=port,
        what=shlex.join(["--resume", str(source)] if resume else [str(source)]),
        overrides="".join(f" \\\n  --set {shlex.quote(o)}" for o in overrides),
        # one node: torchrun's standalone rendezvous on a free port; several: the first node's port
        rendezvous=f' --rdzv-endpoint "$MASTER_ADDR:{port}"' if nodes > 1 else "")
    # every #SBATCH line before the first command: sbatch reads none after it
    text = "\n".join(["#!/bin/bash", SBATCH_MARK, *(f"#SBATCH {option}" for option in options), body])
    atomic_write_text(out, text)
    out.chmod(0o755)
    return script


def _check_script_out(out: Path, recipe: str) -> None:
    """The script never replaces the recipe (or sits inside it), nor a file that an earlier run of this tool did not
    write."""
    check_output_file(out, [recipe], option="--out")
    if out.exists():
        with open(out, "rb") as handle:
            head = handle.read(4096).decode("utf-8", errors="replace").splitlines()[:2]
        if head[1:] != [SBATCH_MARK]:
            raise ValueError(f"--out: {out} exists and was not written by openrecipes launch slurm; choose another "
                             "--out or remove it yourself")
