"""Optimizer component test on CUDA at a reduced shape: offloaded arms run their update on the host."""

import pytest

from openrecipes.verify.optimizer import LayerShape, run_component_test

pytestmark = pytest.mark.gpu


def test_component_test_passes_on_cuda():
    shape = LayerShape(hidden=512, experts=16, top_k=4, ffn=256, tokens=1024)
    report = run_component_test(shape=shape, device="cuda")
    assert report.passed, [(a.name, a.errors, a.ok) for a in report.arms]
    offloaded = [a for a in report.arms if a.offload_fraction > 0]
    on_device = [a for a in report.arms if a.role == "candidate" and a.offload_fraction == 0]
    assert offloaded and on_device
    for arm in offloaded + on_device:
        assert arm.errors[3] <= 0.5 * report.bounds[3], arm.name
