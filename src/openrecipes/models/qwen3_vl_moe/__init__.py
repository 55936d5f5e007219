from openrecipes.models.qwen3_vl_moe.config import Qwen3VLMoeConfig, Qwen3VLMoeVisionConfig
from openrecipes.models.qwen3_vl_moe.model import Qwen3VLMoeForConditionalGeneration, build_qwen3_vl_moe

__all__ = ["Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeVisionConfig", "build_qwen3_vl_moe"]
