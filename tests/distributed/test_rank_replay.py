"""The program `openrecipes measure-rank` runs is the real rank's program (issue 58, item 4): given what the real
ranks send it, one rank run alone computes what the same rank computes in a real gloo run of the same layout, bit
for bit on CPU.

What is compared: every value the rank contributes to an exchange (its loss sum and squared gradient norm to their
sums, its gradients to their reductions, its activations, gradients and expert rows to its peers), and at each step
its loss, gradient norm and the gradient of each shard it holds. The contributions are the substance: a figure the
rank reads back from a sum over ranks (the loss, the norm, a gradient FSDP reduce-scatters) is the replayed sum, equal
by construction; gradients no reduction touches (expert-parallel experts, TP slices, pipeline stages) are its own.

How: the real run is ``measure_rank`` itself with ``alone=False`` (same recipe, same build, same ``train_step``;
torch's own pipeline stages instead of ``run_alone``, the expert counts exchanged instead of mirrored) in N gloo
processes whose every exchange is recorded (tests/distributed/replay_groups.py). The rank is then run alone as
measure-rank runs it (``alone=True``: mirrored routing, ``LoneStage``), its process group answering each exchange
with the recorded values. The real side is the measured function rather than the engine's ``train`` loop so that the
two sides differ only in what the tool assumes; the loop adds data loading order, metrics and checkpoints around
the same ``build_model`` and ``train_step``.

Two exchanges of the real rank have no counterpart in the rank run alone, by design, and run unrecorded:
- its pipeline's warm-up (torch's shape vote and shape inference; a ``LoneStage`` is given the shapes, and torch
  checks every microbatch against them);
- the expert row counts: the rank alone takes them as its own (``assume_mirrored_routing``). The real side
  exchanges them and asserts, at every forward, that they equal the mirrored ones: under the balanced routing
  ``measured_recipe`` turns on (both sides run that recipe) the assumption changes nothing.

One value a rank contributes is measured, not computed: its memory peak, which a pipeline's ranks gather per stage
(``peak_gib_per_stage``); both sides report the same made-up peak (``MEASURED_PEAK``).

What this does not show: times or communication (nothing here is timed), or anything of other routing.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed import replay_groups
from tests.distributed.conftest import TINY_QWEN3 as EXAMPLE

STEPS = 2
MEASURED_PEAK = mock.patch("openrecipes.train.loop.rank_peak_bytes", lambda device, peak: 2.0**30)
LAYOUTS = {"DP2-EP2": ("layout.ep=2",),
           "TP2-SP": ("layout.dp=1", "layout.tp=2", "layout.sequence_parallel=true"),
           "PP2": ("layout.pp=2",),
           "CP2": ("layout.dp=1", "layout.cp=2")}


@pytest.fixture(scope="module")
def recordings(run_dir, tmp_path_factory):
    """Each layout's real run, recorded once for the tests that replay it."""
    cache: dict[str, list[dict]] = {}

    def recorded(layout: str) -> list[dict]:
        if layout not in cache:
            cache[layout] = record(run_dir, LAYOUTS[layout], tmp_path_factory.mktemp(layout))
        return cache[layout]
    return recorded


@pytest.fixture(autouse=True)
def one_thread():
    """The replayed rank runs in this process; one thread, as each recorded rank, so that the sums run in the same
    order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recipe_of(run_dir, sets, world=2):
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.layout import with_world_size
    from openrecipes.config.recipe import load_recipe
    from openrecipes.train.rank_measure import measured_recipe

    recipe = load_recipe(EXAMPLE, [f"run_dir={run_dir}", *sets])
    recipe = measured_recipe(recipe.model_copy(update={"layout": with_world_size(recipe.layout, world)}))
    return recipe, recipe_model_config(recipe)


def _real_program_unrecorded_where_alone_assumes() -> list[int]:
    """In a recording process: run unrecorded the exchanges the rank alone answers itself (the module's docstring),
    and check the mirrored expert counts against the real ones; returns the count of those checks (in a list that
    grows as they run). Patched class-wide: the process runs nothing but this rank."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from openrecipes.parallel.expert import ExpertParallelDispatcher

    warm_up = _PipelineSchedule._initialize_pp_stages

    def unrecorded_warm_up(self, *args, **kwargs):
        with replay_groups.unrecorded():
            return warm_up(self, *args, **kwargs)

    exchanged = ExpertParallelDispatcher._received_counts
    checks = [0]

    def checked_counts(self, counts_E):
        with replay_groups.unrecorded():
            real = exchanged(self, counts_E)
        self.mirrored = True
        try:
            mirrored = exchanged(self, counts_E)
        finally:
            self.mirrored = False
        assert torch.equal(real, mirrored), f"real expert counts {real.tolist()}, mirrored {mirrored.tolist()}"
        checks[0] += 1
        return real

    _PipelineSchedule._initialize_pp_stages = unrecorded_warm_up
    ExpertParallelDispatcher._received_counts = checked_counts
    return checks


def _record(rank, world, port, run_dir, sets, out):
    """One process of the real run: rank ``rank`` of ``world`` over gloo, its exchanges recorded."""
    from openrecipes.train.rank_measure import measure_rank

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    mirrored_checks = _real_program_unrecorded_where_alone_assumes()
    recipe, config = recipe_of(run_dir, sets, world)
    gradients: list[dict[str, torch.Tensor]] = []
    with MEASURED_PEAK:
        result = measure_rank(recipe, config, rank=rank, world=world, steps=STEPS, device=torch.device("cpu"),
                              join=functools.partial(replay_groups.join_recording, port=port), alone=False,
                              on_gradients=lambda step, grads: gradients.append(grads))
    torch.save({"logs": replay_groups.recorded_logs(), "loss": result["loss"], "grad_norm": result["grad_norm"],
                "gradients": gradients, "mirrored_checks": mirrored_checks[0]}, Path(out) / f"rank-{rank}.pt")


def record(run_dir, sets, out, world=2):
    """Run the real layout in ``world`` gloo processes; each rank's recording, loss and gradients by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_record, args=(world, port, str(run_dir), sets, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank-{rank}.pt", weights_only=False) for rank in range(world)]


def replay(run_dir, sets, recorded, rank, world=2):
    """Run rank ``rank`` alone as measure-rank does, every exchange answered from ``recorded``: its figures, its
    gradients per step, and where it contributed other values than the real rank."""
    from openrecipes.train.rank_measure import measure_rank

    recipe, config = recipe_of(run_dir, sets, world)
    gradients: list[dict[str, torch.Tensor]] = []
    with MEASURED_PEAK:
        result = measure_rank(recipe, config, rank=rank, world=world, steps=STEPS, device=torch.device("cpu"),
                              join=functools.partial(replay_groups.join_replay, recorded["logs"]),
                              on_gradients=lambda step, grads: gradients.append(grads))
    left = replay_groups.unreplayed()
    assert not left, f"the rank alone stopped short of the recording: exchanges left per group {left}"
    return result, gradients, replay_groups.differences()


def assert_same_rank(real, alone, gradients, differences):
    """Every value the rank contributed to an exchange (its loss sum and squared gradient norm to their sums, its
    gradients to their reductions, its activations and expert rows to its peers) as the real rank's, bit for bit;
    and its step's loss, gradient norm and every gradient shard it holds (those a reduction leaves it are the
    replayed ones, those it keeps alone, such as expert-parallel gradients, its own)."""
    assert not differences, differences[:5]
    assert alone["loss"] == real["loss"] and alone["grad_norm"] == real["grad_norm"]
    assert len(gradients) == len(real["gradients"]) == STEPS
    for step, (mine, theirs) in enumerate(zip(gradients, real["gradients"])):
        assert mine.keys() == theirs.keys() and mine, step
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=lambda m: f"{step} {name}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_alone_computes_what_the_real_rank_computes(run_dir, recordings, layout):
    recorded = recordings(layout)
    # the expert layout's real ranks checked the mirrored counts at every MoE forward
    assert (recorded[1]["mirrored_checks"] > 0) == (layout == "DP2-EP2")
    ranks = [0, 1] if layout == "PP2" else [1]  # the pipeline's first stage and its last (the loss)
    for rank in ranks:
        assert_same_rank(recorded[rank], *replay(run_dir, LAYOUTS[layout], recorded[rank], rank))


def test_a_rank_replayed_into_another_layout_is_caught(run_dir, recordings):
    with pytest.raises(replay_groups.ReplayMismatch, match="where the recorded rank issued"):
        replay(run_dir, ("layout.dp=2",), recordings("DP2-EP2")[1], 1)


def test_a_rank_given_other_values_computes_other_values(run_dir, recordings):
    """The comparison sees values, not only the order and shapes of the exchanges: one token row the first expert
    exchange delivers, moved by one, changes the expert output the rank sends back."""
    recorded = dict(recordings("DP2-EP2")[1])
    logs = [list(log) for log in recorded["logs"]]
    index = next(i for i, entry in enumerate(logs[0]) if entry.op == "all_to_all")
    entry = logs[0][index]
    moved = entry.received[0].clone()
    moved[0] += 1
    logs[0][index] = replay_groups.Exchange(entry.op, entry.metas, entry.sent, [moved])
    alone, gradients, differences = replay(run_dir, LAYOUTS["DP2-EP2"], {**recorded, "logs": logs}, 1)
    assert differences and differences[0].startswith(f"group 0, exchange {index + 1} (all_to_all)"), differences
    with pytest.raises(AssertionError):
        assert_same_rank(recorded, alone, gradients, differences)
