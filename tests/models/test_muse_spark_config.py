import dataclasses

import pytest

from openrecipes.models.muse_spark.config import FULL, SLIDING, MuseSparkConfig, default_layer_types
from openrecipes.models.registry import get_config


def test_full_config_matches_published_counts():
    config = get_config("muse-spark-open-816b-a42b")
    assert isinstance(config, MuseSparkConfig)
    assert config.active_params() == 44_432_883_712
    assert round(config.non_embedding_params() / 1e9, 1) == 816.7
    assert config.layer_types.count(FULL) == 16 and config.layer_types.count(SLIDING) == 46
    assert config.full_attention_layers()[-1] == 61
    assert config.full_attention_layers()[:3] == [3, 7, 11]


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
    assert default_layer_types(8) == (SLIDING, SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL)
    assert default_layer_types(62).count(FULL) == 16


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
