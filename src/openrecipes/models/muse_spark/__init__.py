from openrecipes.models.muse_spark.config import MuseSparkConfig, default_layer_types

__all__ = ["MuseSparkConfig", "default_layer_types"]
