"""One rank of a layout measured alone under the fake process group (train/rank_measure.py, `openrecipes
measure-rank`): the rank builds exactly its shards, its expert exchange receives what the real all-to-all delivers
under balanced routing, a pipeline stage holds its own layers and runs every microbatch of its schedule, and each
step is finite and timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.conftest import TINY_QWEN3 as EXAMPLE

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def measure(run_dir, rank, world, *sets):
    out = Path(run_dir).parent / f"rank-{world}-{rank}-{'-'.join(sets)}.json"
    args = [sys.executable, "-m", "openrecipes.train.rank_measure", str(EXAMPLE), "--rank", str(rank), "--world",
            str(world), "--steps", "2", "--out", str(out)]
    for item in (f"run_dir={run_dir}", *sets):
        args += ["--set", item]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def assert_timed(result):
    assert all(s > 0 for s in result["phases_s"].values()), result["phases_s"]
    assert {"forward", "backward", "optimizer"} <= set(result["phases_s"])


def test_dp2_ep2_ranks_hold_their_shards_and_receive_balanced_rows(run_dir):
    whole = measure(run_dir, 0, 1)["parameters"]
    ranks = [measure(run_dir, r, 2, "layout.ep=2") for r in (0, 1)]
    # each rank holds half the experts; FSDP2 splits the dense weights between the two
    assert [r["parameters"]["experts"] for r in ranks] == [whole["experts"] // 2] * 2
    assert sum(r["parameters"]["dense"] for r in ranks) == whole["dense"]
    for r in ranks:
        assert_timed(r)
        # balanced routing: each of the 2 sources sends half of its tokens' top-k copies to this rank, so a rank
        # receives its own tokens x top-k in every MoE layer (qwen3-moe-tiny: top 2)
        tokens = r["rows_per_microbatch"] * r["row_tokens"]
        assert r["expert_rows_received"] and set(r["expert_rows_received"]) == {tokens * 2}


def test_an_exchange_that_delivers_nothing_keeps_the_step_finite(run_dir, tmp_path):
    """A fake group may leave its receiving buffers unwritten (torch 2.11's does; later ones copy something in), and
    on a GPU those hold whatever memory held, NaN bit patterns included. Here the all-to-all writes nothing and every
    empty tensor is NaN (torch's fill_uninitialized_memory), so a buffer the rank reads before anything writes it
    makes the step non-finite (the measurement refuses such a step)."""
    out = tmp_path / "rank.json"
    script = ("import runpy, sys, torch, torch.distributed as dist; "
              "torch.use_deterministic_algorithms(True, warn_only=True); "
              "torch.utils.deterministic.fill_uninitialized_memory = True; "
              "dist.all_to_all_single = lambda *args, **kwargs: None; sys.argv[0] = 'rank_measure'; "
              "runpy.run_module('openrecipes.train.rank_measure', run_name='__main__')")
    args = [sys.executable, "-c", script, str(EXAMPLE), "--rank", "1", "--world", "2", "--steps", "2", "--out",
            str(out), "--set", f"run_dir={run_dir}", "--set", "layout.ep=2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(torch.isfinite(torch.tensor(result["grad_norm"]))) and result["expert_rows_received"]


def test_the_rank_runs_under_the_recipes_allocator(run_dir, monkeypatch):
    """The real job sets kernels.allocator before its first allocation (train/loop.py); a measured rank must too, or
    its reserved peak (and whether it fits) is another allocator's."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.models.resolve import resolve_model_config
    from openrecipes.parallel import mesh
    from openrecipes.train.rank_measure import measure_rank, measured_recipe

    kinds = []
    monkeypatch.setattr(mesh, "use_cuda_allocator", kinds.append)
    recipe = measured_recipe(load_recipe(EXAMPLE, [f"run_dir={run_dir}", "kernels.allocator=caching"]))
    torch.set_num_threads(1)
    measure_rank(recipe, resolve_model_config(recipe.model), rank=0, world=1, steps=1)
    assert kinds == ["caching"]


@pytest.mark.slow
def test_tp2_rank_is_finite_and_holds_a_slice(run_dir):
    whole = measure(run_dir, 0, 1)["parameters"]
    result = measure(run_dir, 1, 2, "layout.tp=2", "layout.sequence_parallel=true", "layout.dp=1")
    assert_timed(result)
    assert result["parameters"]["dense"] < whole["dense"]
    assert result["parameters"]["experts"] == whole["experts"]  # ep=1: every expert on every rank


def stage_parameters(stage, pp):
    """The parameters of pipeline stage ``stage`` of ``pp``: the one-process model cut by the engine's own split."""
    from openrecipes.checkpoint.hf import recipe_model_config
    from openrecipes.config.layout import rank_layers, with_world_size
    from openrecipes.config.recipe import load_recipe
    from openrecipes.models.families import family_for_config
    from openrecipes.parallel.pipeline import prune_to_stage
    from openrecipes.train.rank_measure import local_parameters

    recipe = load_recipe(EXAMPLE, [f"layout.pp={pp}"])
    config = recipe_model_config(recipe)
    family = family_for_config(config)
    model = family.build(config, device="cpu", dtype=torch.float32, seed=0)
    ((_, layers),) = rank_layers(with_world_size(recipe.layout, pp), config.num_hidden_layers, stage)
    prune_to_stage(model, family.sharding, set(layers), first=stage == 0, last=stage == pp - 1)
    return local_parameters(model)


def test_pp2_stages_hold_their_layers_and_run_the_whole_schedule(run_dir):
    for stage in (0, 1):
        result = measure(run_dir, stage, 2, "layout.pp=2")
        assert result["pp_rank"] == stage
        assert result["parameters"] == stage_parameters(stage, 2)
        # 1F1B: every microbatch of the step forward and backward; stage s keeps up to pp - s of them in flight
        microbatches = result["microbatches"]
        assert microbatches >= 2
        assert result["pipeline"] == {"stages": [stage], "microbatches": microbatches,
                                      "forwards_per_step": microbatches, "backwards_per_step": microbatches,
                                      "most_in_flight": [min(2 - stage, microbatches)]}
        assert all(s > 0 for s in result["phases_s"].values()), result["phases_s"]
        assert {"forward_backward", "optimizer"} <= set(result["phases_s"])
        # the last stage computes the step's loss; the first reports none
        assert (result["loss"][-1] > 0) == (stage == 1)


def test_interleaved_rank_runs_both_its_chunks(run_dir):
    result = measure(run_dir, 1, 2, "layout.pp=2", "layout.vpp=2")
    pipeline = result["pipeline"]
    # rank 1 of PP2 VPP2 holds virtual stages 1 and 3 (the last), each running every microbatch
    assert pipeline["stages"] == [1, 3]
    assert pipeline["forwards_per_step"] == pipeline["backwards_per_step"] == 2 * result["microbatches"]
    assert result["loss"][-1] > 0


def test_default_ranks_of_pp2_dp2_cover_both_stages():
    from openrecipes.config.layout import LayoutConfig
    from openrecipes.train.rank_cli import default_ranks

    layout = LayoutConfig(pp=2, dp=2, ep=2, max_tokens_per_gpu=8192)
    assert default_ranks(layout, 4) == [0, 2]


@pytest.mark.slow
def test_command_measures_pp2_dp2_ep2_at_both_stages(tmp_path):
    done = subprocess.run([sys.executable, "-m", "openrecipes", "measure-rank", str(EXAMPLE), "--gpus", "4xH200",
                           "--set", "layout.pp=2", "--set", "layout.ep=2", "--steps", "2", "--out",
                           str(tmp_path / "pp"), "--json"], capture_output=True, text=True, timeout=300,
                          env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(done.stdout)["ranks"]
    assert [(r["rank"], r["pp_rank"]) for r in ranks] == [(0, 0), (2, 1)]
    whole = [stage_parameters(stage, 2) for stage in (0, 1)]
    for r, stage in zip(ranks, whole):
        assert r["parameters"]["experts"] == stage["experts"] // 2  # EP2: half the stage's experts
        assert r["pipeline"]["forwards_per_step"] == r["microbatches"]
        assert r["predicted"]["compute_s"] > 0


@pytest.mark.slow
def test_command_prints_each_rank_beside_the_planner(tmp_path):
    done = subprocess.run([sys.executable, "-m", "openrecipes", "measure-rank", str(EXAMPLE), "--gpus", "2xH200",
                           "--set", "layout.ep=2", "--ranks", "1", "--steps", "2", "--out", str(tmp_path / "m"),
                           "--json"], capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (rank,) = report["ranks"]
    assert rank["rank"] == 1 and rank["predicted"]["allocated_gib"] > 0 and rank["predicted"]["compute_s"] > 0
    assert "measure-rank: rank 1 of 2" in done.stderr


def test_default_ranks_take_each_distinct_stage():
    from openrecipes.config.layout import LayoutConfig
    from openrecipes.train.rank_cli import default_ranks

    assert default_ranks(LayoutConfig(ep=8, dp=8, max_tokens_per_gpu=8192), 48) == [0]
    layout = LayoutConfig(tp=4, pp=16, ep=8, dp=2, sequence_parallel=True, max_tokens_per_gpu=8192)
    assert default_ranks(layout, 64) == [0, 8, 8 * 15]  # first, one middle, last
    # the Muse Spark seed: 62 layers as 3, 4 x 14, 3
    seed = layout.model_copy(update={"pp_first_stage_layers": 3, "pp_last_stage_layers": 3})
    assert default_ranks(seed, 62) == [0, 8, 8 * 15]
    uneven = LayoutConfig(pp=4, dp=2, pp_first_stage_layers=1, pp_last_stage_layers=3,
                          max_tokens_per_gpu=8192)
    assert default_ranks(uneven, 10) == [0, 2, 6]


def _exchange(rank, world, port, results):
    from openrecipes.parallel.expert import ExpertParallelDispatcher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # balanced routing of this rank's 6 tokens x top 2 over 4 experts (2 per rank), round-robin as the model's
        counts_E = torch.bincount(torch.arange(12) % 4, minlength=4)
        dispatcher = ExpertParallelDispatcher(group=dist.group.WORLD, ep_size=world, num_experts=4,
                                              compute_dtype=None)
        real = dispatcher._received_counts(counts_E)
        dispatcher.mirrored = True
        results[rank] = (real.tolist(), dispatcher._received_counts(counts_E).tolist())
    finally:
        dist.destroy_process_group()


def test_mirrored_counts_equal_the_real_all_to_all_under_balance():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_exchange, args=(2, port, results), nprocs=2, join=True)
    for rank in (0, 1):
        real, mirrored = results[rank]
        assert real == mirrored
