"""The metrics stream: RUN_DIR/metrics.jsonl (one flushed JSON line per step), a live progress line, and
TensorBoard / Weights & Biases when asked for."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from openrecipes.config.rundir import METRICS_FILE, encode_metric
from openrecipes.utils import atomic_write_text, shown_step


def truncate_after(run_dir: Path, step: int) -> None:
    """Drop lines for steps after ``step`` (logged after the checkpoint a resume starts from)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


class MetricsStream:
    def __init__(self, run_dir: Path, *, total_steps: int, progress: bool, tensorboard: bool, wandb: bool,
                 wandb_project: str, run_name: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.interactive = sys.stderr.isatty()
        self.started = time.perf_counter()
        self._file = None
        self._line_open = False  # an interactive progress line ended by '\r', not yet by '\n'
        self._tensorboard = self._wandb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ValueError("logging.tensorboard: the tensorboard package is not installed "
                                 "(pip install tensorboard)") from error
            self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if enabled and wandb:
            try:
                import wandb as wandb_module
            except ImportError as error:
                raise ValueError("logging.wandb: the wandb package is not installed (pip install wandb)") from error
            self._wandb = wandb_module.init(project=wandb_project, name=run_name, dir=str(run_dir))
        # opened last: a logger that cannot start leaves no metrics file behind to block a fresh start
        self._file = open(Path(run_dir) / METRICS_FILE, "a") if enabled else None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({k: encode_metric(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(numbers, step=record["step"])
        if self.progress:
            self._print_progress(record)

    def _print_progress(self, record: dict[str, Any]) -> None:
        done = shown_step(record["step"])
        elapsed = time.perf_counter() - self.started
        memory = record.get("peak_memory_gib")
        # counted from 1 (the last line reads steps/steps); metrics.jsonl keeps the 0-based step numbers
        line = (f"step {done:>5}/{self.total_steps}  loss {record['loss']:.4f}  "
                f"grad {record['grad_norm']:.3f}  lr {record['lr']:.2e}  {record['step_time_s']:.2f} s/step  "
                f"{record['tokens'] / record['step_time_s']:,.0f} tok/s"
                + (f"  mem {memory:.1f} GiB" if memory is not None else "")
                + f"  [{elapsed:.0f} s]")
        end = "\r" if self.interactive and done < self.total_steps else "\n"
        print(line, end=end, file=sys.stderr, flush=True)
        self._line_open = end == "\r"

    def note(self, message: str) -> None:
        """``message`` on a line of its own on stderr (after an open progress line, which it would overwrite)."""
        if not self.enabled:
            return
        print(("\n" if self._line_open else "") + message, file=sys.stderr, flush=True)
        self._line_open = False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
