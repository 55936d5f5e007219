"""Seed 001's GB200 peak allocated memory per pipeline stage against our prediction (GB200: 185 GiB): pretraining,
SFT and long-context SFT (TP4 PP6 CP2, 32,768-token rows: 16,384 tokens per GPU)."""

import pytest

from openrecipes.models.registry import get_config
from openrecipes.config.layout import LayoutConfig
from openrecipes.plan.enumerate import evaluate
from openrecipes.plan.hardware import load_hardware
from openrecipes.plan.memory import TrainingSetup
from openrecipes.plan.shape import model_shape

MUSE = model_shape(get_config("muse-spark-open-816b-a42b"))
SPLIT = dict(pp_first_stage_layers=9, pp_last_stage_layers=9)

CASES = {
    "pretrain": (dict(tp=1, pp=6, ep=32, dp=32, max_tokens_per_gpu=4096, **SPLIT),
                 dict(grad_dtype="bf16", global_batch_tokens=1024 * 4096),
                 [97.2, 104.8, 104.8, 104.8, 104.8, 93.3]),
    "sft": (dict(tp=4, pp=6, ep=32, dp=8, sequence_parallel=True, max_tokens_per_gpu=4096, **SPLIT),
            dict(grad_dtype="fp32", global_batch_tokens=128 * 4096),
            [87.7, 95.6, 95.6, 94.4, 94.4, 80.9]),
    "long_context": (dict(tp=4, pp=6, cp=2, ep=32, dp=4, sequence_parallel=True, max_tokens_per_gpu=16384, **SPLIT),
                     dict(grad_dtype="fp32", global_batch_tokens=8 * 32768),
                     [98.5, 105.8, 107.8, 104.4, 107.5, 89.5]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gb200_stage_peaks_within_15_percent(name):
    layout, setup, observed = CASES[name]
    plan = evaluate(MUSE, LayoutConfig(**layout), TrainingSetup(recompute="full", optimizer="adam", **setup),
                    load_hardware("GB200"))
    predicted = [s.allocated_gib for s in plan.stages]
    assert plan.stage_layers == [9, 11, 11, 11, 11, 9]
    for stage, (want, got) in enumerate(zip(observed, predicted)):
        assert abs(got - want) / want < 0.15, f"stage {stage}: predicted {got:.1f} GiB, seed {want} GiB"


def test_gb200_pp8_alltoall_peak():
    layout = LayoutConfig(tp=1, pp=8, ep=32, dp=32, max_tokens_per_gpu=4096, pp_first_stage_layers=7,
                          pp_last_stage_layers=7)
    plan = evaluate(MUSE, layout, TrainingSetup(recompute="full", grad_dtype="bf16",
                                                global_batch_tokens=1024 * 4096), load_hardware("GB200"))
    peak = max(s.allocated_gib for s in plan.stages)
    assert abs(peak - 80.1) / 80.1 < 0.15
