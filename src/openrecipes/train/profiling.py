"""One training step under torch.profiler (``debug.profile_step``): its kernel table, and its timeline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from openrecipes.config.recipe import Debug
from openrecipes.config.rundir import PROFILE_FILE, PROFILE_TRACE_FILE
from openrecipes.utils import atomic_write_text


def profiled_step(run_dir: Path, debug: Debug, rank: int, fn: Callable[[], dict]) -> dict:
    """Run one step under torch.profiler; write the kernel table to RUN_DIR/profile.txt (rank 0 only), and with
    ``debug.profile_timeline`` the Chrome trace (written through a temporary name: the profiler writes the file)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        record = fn()
    if rank == 0:
        sort = debug.profile_sort or ("cuda_time_total" if torch.cuda.is_available() else "cpu_time_total")
        atomic_write_text(run_dir / PROFILE_FILE, prof.key_averages().table(sort_by=sort, row_limit=40))
        if debug.profile_timeline:
            partial = run_dir / f".{PROFILE_TRACE_FILE}.partial"
            prof.export_chrome_trace(str(partial))
            os.replace(partial, run_dir / PROFILE_TRACE_FILE)
    return record
