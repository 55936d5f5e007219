"""The planner's memory model of image-text training in this engine: the vision towers are frozen (parameters, no
gradients, no optimizer state), the projection trains unless the recipe freezes it; all on the first stage."""

from dataclasses import replace

import pytest

from openrecipes.config.layout import LayoutConfig
from openrecipes.models.registry import get_config
from openrecipes.plan.hardware import GIB, load_hardware
from openrecipes.plan.memory import TrainingSetup, stage_memory
from openrecipes.plan.shape import model_shape


@pytest.mark.parametrize("dp", [1, 2])
def test_frozen_towers_hold_parameters_only(dp):
    config = get_config("qwen3-vl-30b-a3b")
    shape = model_shape(config)
    text_only = replace(shape, frozen_encoder_params=0, encoder_projection_params=0)
    layout = LayoutConfig(max_tokens_per_gpu=4096, dp=dp)
    towers = config.vision.params() - config.vision.projection_params()
    projection = config.vision.projection_params()
    assert shape.frozen_encoder_params == towers + projection and 0 < projection < towers

    def parts(shape, train_projection):
        setup = TrainingSetup(engine="openrecipes", optimizer="adam", global_batch_tokens=4096 * dp,
                              train_projection=train_projection)
        (stage,) = stage_memory(shape, layout, [shape.num_layers], setup, load_hardware("H200"))
        return {k: v * GIB for k, v in stage.parts_gib.items()}

    base, frozen, trained = parts(text_only, True), parts(shape, False), parts(shape, True)
    rounding = 2e6  # parts_gib are rounded to 1e-3 GiB
    # frozen: the whole encoder as parameters (bf16 in one process; under FSDP2 an fp32 shard and the gathered bf16
    # copy), and not a byte more of gradients or optimizer state
    frozen_bytes = 2 * (towers + projection) if dp == 1 else (4 / dp + 2) * (towers + projection)
    assert frozen["params"] - base["params"] == pytest.approx(frozen_bytes, abs=rounding)
    assert frozen["grads"] == pytest.approx(base["grads"], abs=rounding)
    assert frozen["optimizer"] == pytest.approx(base["optimizer"], abs=rounding)
    # a trained projection adds its gradients and optimizer state (adam: bf16 gradients and 12 B of state in one
    # process; fp32 gradients and 8 B of moments per sharded fp32 master under FSDP2), the towers still none
    assert trained["grads"] - base["grads"] == pytest.approx((2 if dp == 1 else 4 / dp) * projection, abs=rounding)
    assert trained["optimizer"] - base["optimizer"] == pytest.approx((12 if dp == 1 else 8 / dp) * projection,
                                                                     abs=rounding)
