"""The planner against what the seed cards report, and its internal consistency."""

from pathlib import Path

import pytest

from openrecipes.models.registry import get_config
from openrecipes.config.layout import LayoutConfig
from openrecipes.plan.enumerate import evaluate, search
from openrecipes.config.hardware import parse_gpus
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup
from openrecipes.plan.shape import model_shape

H200 = load_hardware("H200")
QWEN = model_shape(get_config("qwen3-30b-a3b"))
MUSE = model_shape(get_config("muse-spark-open-816b-a42b"))
QWEN_LAYOUT = LayoutConfig(ep=8, dp=8, max_tokens_per_gpu=16384, rows_per_microbatch=2)
MUSE_LAYOUT = LayoutConfig(tp=4, pp=16, ep=8, dp=2, sequence_parallel=True, pp_first_stage_layers=3,
                           pp_last_stage_layers=3, max_tokens_per_gpu=8192)


def test_shapes_carry_the_exact_active_params():
    assert QWEN.active_params == 3_041_656_832
    assert MUSE.active_params == 44_432_883_712
    assert MUSE.attention_windows.count(None) == 16


@pytest.mark.parametrize("recompute, fits", [("full", True), ("selective", False), ("none", False)])
def test_qwen3_seed_card_fits_only_with_full_recompute(recompute, fits):
    plan = evaluate(QWEN, QWEN_LAYOUT, TrainingSetup(recompute=recompute, optimizer="precision-aware"), H200)
    assert plan.fits is fits
    assert len(plan.stages) == 1


def test_muse_seed_card_fits_and_pp16_without_recompute_does_not():
    fits = evaluate(MUSE, MUSE_LAYOUT, TrainingSetup(recompute="full", optimizer="precision-aware",
                                                     offload_fraction=0.3), H200)
    assert fits.fits and len(fits.stages) == 16
    oom = evaluate(MUSE, MUSE_LAYOUT, TrainingSetup(recompute="none", optimizer="precision-aware",
                                                    offload_fraction=1.0), H200)
    assert not oom.fits
    # stage 1 holds 15 microbatches of 4 layers: the peak; the last stage holds one
    peaks = [s.reserved_gib for s in oom.stages]
    assert peaks.index(max(peaks)) == 1 and peaks[-1] < peaks[1] / 2


def test_memory_responds_to_each_knob():
    base = TrainingSetup(recompute="full", optimizer="adam")
    def peak(layout=MUSE_LAYOUT, **kw):
        return evaluate(MUSE, layout, TrainingSetup(**{**base.__dict__, **kw}), H200).peak_memory_gib
    ref = peak()
    assert peak(optimizer="precision-aware") < ref
    assert peak(offload_fraction=1.0) < peak(offload_fraction=0.5) < ref
    assert peak(recompute="selective") > ref
    assert peak(layout=MUSE_LAYOUT.model_copy(update={"max_tokens_per_gpu": 16384})) > ref
    # more expert-data parallelism shards expert optimizer state further
    wide = MUSE_LAYOUT.model_copy(update={"ep": 4})
    assert peak(layout=wide) > ref  # fewer EP ranks: more experts per GPU


def test_offloaded_state_goes_to_host_memory():
    plan = evaluate(MUSE, MUSE_LAYOUT, TrainingSetup(optimizer="precision-aware", offload_fraction=0.3), H200)
    on_gpu = plan.stages[1].parts_gib["optimizer"]
    assert plan.stages[1].cpu_optimizer_gib == pytest.approx(on_gpu * 0.3 / 0.7, rel=1e-2)


def test_throughput_and_mfu_are_consistent():
    plan = evaluate(MUSE, MUSE_LAYOUT, TrainingSetup(optimizer="precision-aware", offload_fraction=0.3), H200)
    t = plan.throughput
    assert t.microbatches == 64  # 128 rows of 8192 over DP 2
    assert t.bubble_fraction == pytest.approx(15 / 79)
    assert t.mfu == pytest.approx(6 * MUSE.active_params * t.tokens_per_s_per_gpu / 989e12)
    full = plan.throughput.tokens_per_s_per_gpu
    none = evaluate(MUSE, MUSE_LAYOUT, TrainingSetup(recompute="none", optimizer="precision-aware",
                                                     offload_fraction=0.3), H200).throughput
    assert none.tokens_per_s_per_gpu > full  # no extra forward


def test_search_ranks_only_fitting_layouts():
    tiny = model_shape(get_config("qwen3-moe-tiny"))
    kwargs = dict(max_tokens=[4096], recompute=["none", "full"], optimizers=["adam"], offloads=[0.0],
                  global_batch_tokens=8 * 4096 * 4)
    everything, evaluated, valid = search(tiny, 8, load_hardware("H100", memory_gib=1e6), **kwargs)
    assert len(everything) == evaluated == valid > 10  # far below the cap: every valid setting evaluated
    peaks = sorted(p.peak_memory_gib for p in everything)
    capacity = peaks[len(peaks) // 2]
    plans, evaluated_again, _ = search(tiny, 8, load_hardware("H100", memory_gib=capacity), **kwargs)
    assert evaluated_again == evaluated and 0 < len(plans) < evaluated
    assert all(p.fits and p.peak_memory_gib <= capacity for p in plans)
    assert len(plans) == sum(peak <= capacity for peak in peaks)
    speeds = [p.throughput.tokens_per_s_per_gpu for p in plans]
    assert speeds == sorted(speeds, reverse=True)


def test_plans_say_whether_this_engine_runs_the_layout():
    tiny = model_shape(get_config("qwen3-moe-tiny"))
    hw = load_hardware("H100", memory_gib=1e6)
    ours, _, _ = search(tiny, 8, hw, engine="openrecipes", max_tokens=[4096], recompute=["full"], optimizers=["adam"],
                        offloads=[0.0], global_batch_tokens=8 * 4096 * 4)
    assert ours and all(p.to_json()["openrecipes_runs_it"] for p in ours)
    interleaved = LayoutConfig(pp=2, vpp=2, dp=4, max_tokens_per_gpu=4096)
    plan = evaluate(tiny, interleaved, TrainingSetup(engine="openrecipes", global_batch_tokens=8 * 4096 * 4), hw)
    assert plan.to_json()["openrecipes_runs_it"] is True
    without_sp = LayoutConfig(tp=2, dp=4, max_tokens_per_gpu=4096)  # TP runs with sequence parallelism only
    plan = evaluate(tiny, without_sp, TrainingSetup(engine="openrecipes", global_batch_tokens=8 * 4096 * 4), hw)
    assert plan.to_json()["openrecipes_runs_it"] is False


@pytest.mark.parametrize("model, layout", [
    ("gpt-oss-tiny", dict(ep=2, dp=4)), ("gpt-oss-tiny", dict(tp=2, sequence_parallel=True, dp=4)),
    ("gpt-oss-tiny", dict(cp=2, dp=4)), ("qwen3.5-moe-tiny", dict(tp=2, sequence_parallel=True, dp=4)),
    ("qwen3.5-moe-tiny", dict(cp=2, dp=4))])
def test_a_dimension_the_family_does_not_split_is_not_this_engines(model, layout, tmp_path):
    """Declared by the family (ModelFamily.not_split): never ranked for this engine, predicted as the generic
    engine's under auto, and refused by name before train starts a process."""
    from openrecipes.config.recipe import load_recipe
    from openrecipes.train.cli import _check_layout

    shape, hw = model_shape(get_config(model)), load_hardware("H100", memory_gib=1e6)
    (field,) = [k for k, v in layout.items() if k in ("ep", "tp", "cp") and v > 1]
    ours, _, _ = search(shape, 8, hw, engine="openrecipes", max_tokens=[4096], recompute=["full"],
                        optimizers=["adam"], offloads=[0.0], global_batch_tokens=8 * 4096 * 4)
    assert ours and not any(getattr(p.layout, field) > 1 for p in ours)
    split = LayoutConfig(**layout, max_tokens_per_gpu=4096)
    plan = evaluate(shape, split, TrainingSetup(engine="openrecipes", global_batch_tokens=8 * 4096 * 4), hw)
    assert plan.to_json()["openrecipes_runs_it"] is False and plan.engine_refusal.startswith(f"layout.{field}: ")
    example = {"gpt-oss-tiny": "tiny-gpt-oss-sft.yaml", "qwen3.5-moe-tiny": "tiny-qwen3-5-moe-sft.yaml"}[model]
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "examples" / example,
                         [f"run_dir={tmp_path / 'run'}", *(f"layout.{k}={str(v).lower()}" for k, v in layout.items()),
                          "global_batch=8"])
    with pytest.raises(ValueError, match=f"^layout.{field}: "):
        _check_layout(recipe, get_config(model), split.world_size)
    assert not (tmp_path / "run").exists()


def test_invalid_layout_and_gpu_strings():
    with pytest.raises(ValueError, match="^layout.tp: "):
        evaluate(MUSE, MUSE_LAYOUT.model_copy(update={"tp": 16, "dp": 1, "pp": 8, "ep": 16,
                                                      "pp_first_stage_layers": 6, "pp_last_stage_layers": 8}),
                 TrainingSetup(), H200)
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus("H200x8")
    with pytest.raises(ValueError, match="--gpus"):
        load_hardware("A100")
    with pytest.raises(ValueError, match="offload_fraction"):
        TrainingSetup(offload_fraction=1.5)
    assert parse_gpus("128xH200") == (128, "H200")
