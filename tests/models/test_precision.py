"""fp32-pinned parameters: which they are, and the check that fails when a loader stored them below fp32."""

import pytest
import torch

from openrecipes.models.common.precision import check_fp32_parameters, fp32_parameter_names
from openrecipes.models.muse_spark.model import build_muse_spark
from openrecipes.models.qwen3_moe import build_qwen3_moe
from openrecipes.models.registry import get_config

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.expert_bias", "residual_gate.weight")


def test_pinned_names_are_the_router_and_the_residual_gates():
    model = build_muse_spark(get_config("muse-spark-tiny"), seed=0, dtype=torch.bfloat16)
    names = fp32_parameter_names(model)
    assert names == [n for n, _ in model.named_parameters() if n.endswith(FP32_SUFFIXES)]
    assert len(names) == 4 * 4  # router weight, expert bias, two residual gates; 4 layers
    check_fp32_parameters(model)
    check_fp32_parameters(model.double())  # wider is allowed
    assert fp32_parameter_names(build_qwen3_moe(get_config("qwen3-moe-tiny"), seed=0)) == []


def test_check_names_every_tensor_stored_below_fp32():
    model = build_muse_spark(get_config("muse-spark-tiny"), seed=0, dtype=torch.bfloat16)
    layer = model.model.language_model.layers["2"]
    layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.bfloat16()  # what a .data-replacing loader does
    layer.mlp_residual_gate.weight.data = layer.mlp_residual_gate.weight.data.half()
    with pytest.raises(ValueError, match=r"2 parameter\(s\) must be fp32.*layers\.2\.mlp\.gate\.weight \(bfloat16\)"
                                         r".*layers\.2\.mlp_residual_gate\.weight \(float16\)"):
        check_fp32_parameters(model)
