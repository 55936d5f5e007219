import dataclasses

import pytest

from openrecipes.config.layout import LayoutConfig, stage_layer_counts
from openrecipes.models.muse_spark.config import FULL, SLIDING, MuseSparkConfig, default_layer_types
from openrecipes.models.registry import get_config


def test_full_config_matches_published_counts():
    config = get_config("muse-spark-open-816b-a42b")
    assert isinstance(config, MuseSparkConfig)
    assert config.active_params() == 44_432_883_712
    assert round(config.non_embedding_params() / 1e9, 1) == 816.7
    assert config.layer_types.count(FULL) == 16 and config.layer_types.count(SLIDING) == 46
    assert config.full_attention_layers() == list(range(0, 62, 4))


def test_active_params_by_component():
    c = MuseSparkConfig()
    per_layer = (3 * 8192 * 8192 + 2 * 8192 * 1024  # q, o, output gate; k, v
                 + 2 * 8192 * 4096 + 8192 * 256 + 8 * 3 * 4096 * 4096)  # latent, router, top-8 experts
    assert c.num_hidden_layers * per_layer + 202_048 * 8192 == c.active_params()
    # residual gates and norms are outside N but inside the total
    assert c.total_params() - c.non_embedding_params() == 2 * 202_048 * 8192
    assert c.total_params() > c.num_hidden_layers * (c.dense_layer_params() + 256 * c.expert_params())


def test_tiny_config_is_small_and_mixed():
    tiny = get_config("muse-spark-tiny")
    assert set(tiny.layer_types) == {FULL, SLIDING}
    assert tiny.total_params() < 1_000_000
    assert tiny.active_params() < tiny.total_params()


def test_default_layer_types_rule():
    assert default_layer_types(8) == (FULL, SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING)
    assert default_layer_types(62).count(FULL) == 16


def _full_layers_per_stage(full_layers, layout):
    counts = stage_layer_counts(layout, 62)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [sum(start <= i < start + n for i in full_layers) for start, n in zip(starts, counts)]


@pytest.mark.parametrize("pp, end_stage_layers, per_stage", [
    (16, 3, 1),  # the seed recipe: stages of 3, 4 x 14, 3 layers
    (8, 7, 2),   # 7, 8 x 6, 7
    (4, 15, 4),  # 15, 16, 16, 15
])
def test_default_placement_puts_the_same_number_of_full_layers_in_every_stage(pp, end_stage_layers, per_stage):
    layout = LayoutConfig(pp=pp, pp_first_stage_layers=end_stage_layers, pp_last_stage_layers=end_stage_layers,
                          max_tokens_per_gpu=8192)
    full = MuseSparkConfig().full_attention_layers()
    assert _full_layers_per_stage(full, layout) == [per_stage] * pp
    if pp == 16:  # the earlier placement (3, 7, ..., 59, 61) left the first stage none and the last two
        old = [*range(3, 60, 4), 61]
        assert len(old) == 16 and _full_layers_per_stage(old, layout)[::15] == [0, 2]


def test_placement_from_config_json_wins_over_the_default():
    listed = [FULL if i in (3, 61) else SLIDING for i in range(62)]
    config = MuseSparkConfig.from_hf_dict({"model_type": "muse_spark", "layer_types": listed})
    assert config.full_attention_layers() == [3, 61]
    nested = MuseSparkConfig.from_hf_dict({"model_type": "muse_spark", "text_config": {"layer_types": listed}})
    assert nested.layer_types == tuple(listed)
    assert MuseSparkConfig.from_hf_dict(config.to_hf_dict()).layer_types == tuple(listed)


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=7), "num_key_value_heads"),
    (dict(layer_types=(FULL,) * 3), "layer_types"),
    (dict(num_hidden_layers=2, layer_types=(FULL, "local")), "layer_types"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        MuseSparkConfig(**change)


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MuseSparkConfig().hidden_size = 1
    with pytest.raises(TypeError):
        MuseSparkConfig(202048)  # type: ignore[misc]
