"""The measurement formulas against the published recipe cards' numbers."""

import math

import pytest

from openrecipes.measure import (
    attention_flops,
    gpu_hours,
    load_hardware,
    mfu,
    model_flops,
    step_time_stats,
    tokens_per_s_per_gpu,
    usd_per_million_tokens,
    window_tokens,
)

PRICE = 7.912  # USD per GPU-hour, the figure that reproduces both cards


def test_window_tokens_of_the_cards():
    assert window_tokens(15, 128, 8192) == 15_728_640


@pytest.mark.parametrize(
    "throughput, active, card_mfu, card_usd",
    [
        (6913.23, 3_041_656_832, 0.1276, "0.32"),  # Qwen3-30B-A3B on 8 H200
        (333.12, 44_432_883_712, 0.0898, "6.60"),  # Muse Spark on 128 H200
    ],
)
def test_seed_cards_mfu_and_cost(throughput, active, card_mfu, card_usd):
    peak = load_hardware().gpu("H200").peak_bf16_dense_flops
    value = mfu(active, throughput, peak)
    assert round(value, 4) == card_mfu
    assert f"{usd_per_million_tokens(PRICE, throughput):.2f}" == card_usd


def test_card_mfu_percent_rounding():
    peak = load_hardware().gpu("H200").peak_bf16_dense_flops
    assert f"{mfu(3_041_656_832, 6913.23, peak) * 100:.1f}" == "12.8"
    assert f"{mfu(44_432_883_712, 333.12, peak) * 100:.1f}" == "9.0"


def test_price_range_stated_in_the_design_reproduces_both_cards():
    # prices from 7.909 to 7.920 round to both cards' figures (7.921 already gives $6.61)
    for price in (7.909, 7.920):
        assert f"{usd_per_million_tokens(price, 6913.23):.2f}" == "0.32"
        assert f"{usd_per_million_tokens(price, 333.12):.2f}" == "6.60"
    assert f"{usd_per_million_tokens(7.908, 333.12):.2f}" == "6.59"
    assert f"{usd_per_million_tokens(7.921, 333.12):.2f}" == "6.61"


def test_tokens_per_second_inverts_window_time():
    seconds = 15_728_640 / 8 / 6913.23
    assert tokens_per_s_per_gpu(15_728_640, seconds, 8) == pytest.approx(6913.23, rel=1e-12)
    with pytest.raises(ValueError):
        tokens_per_s_per_gpu(1, 0.0, 8)
    with pytest.raises(ValueError):
        tokens_per_s_per_gpu(1, 1.0, 0)


def test_step_time_cv_uses_population_std():
    mean, std, cv = step_time_stats([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert std == pytest.approx(math.sqrt(1.25))  # ddof=0; the sample std would be sqrt(5/3)
    assert cv == pytest.approx(math.sqrt(1.25) / 2.5)


def test_attention_flops_counts_two_causal_matmuls_forward_and_backward():
    # one layer, one head of dim 1, one document of length 4: forward = 2 matmuls x 2 FLOPs x 16 / 2
    assert attention_flops(1, 1, 1, 16) == 3 * (2 * 2 * 16 / 2)
    # linear in layers, heads, head_dim and sum of squared document lengths
    assert attention_flops(48, 32, 128, 2 * 8192**2) == 2 * attention_flops(48, 32, 128, 8192**2)
    total = model_flops(10, 100, num_layers=2, num_heads=3, head_dim=4, sum_doc_len_sq=50)
    assert total == 6 * 10 * 100 + 6 * 2 * 3 * 4 * 50


def test_gpu_hours():
    assert gpu_hours(8, 3600.0) == 8.0
    assert gpu_hours(128, 900.0) == 32.0
