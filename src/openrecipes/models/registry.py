"""Named model configurations. Values are written here, in the project, not downloaded."""

from __future__ import annotations

from typing import Any, Callable

from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

# name -> factory returning a config; a model family registers its own entries here
_REGISTRY: dict[str, Callable[[], Any]] = {}


def register(name: str, factory: Callable[[], Any]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = factory


def get_config(name: str) -> Any:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def names() -> list[str]:
    return list(_REGISTRY)


# Qwen/Qwen3-30B-A3B config.json (revision ad44e777bcd18fa416d9da3bd8f70d33ebb85d39), field by field.
register("qwen3-30b-a3b", lambda: Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645,
))

# Small enough for CPU tests and the demo; num_attention_heads * head_dim != hidden_size on purpose.
register("qwen3-moe-tiny", lambda: Qwen3MoeConfig(
    vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=10_000.0, max_position_embeddings=4096,
))

# Muse Spark Open: the DESIGN.md architecture (published facts plus documented derived sizes).
from openrecipes.models.muse_spark.config import MuseSparkConfig  # noqa: E402

register("muse-spark-open-816b-a42b", lambda: MuseSparkConfig())

# CPU-sized Muse Spark: mixed layer types (layers 1 and 3 full), latent experts, small window.
register("muse-spark-tiny", lambda: MuseSparkConfig(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=16, moe_latent_size=32, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, max_position_embeddings=4096,
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
))
