from openrecipes.models.qwen3_5_moe.config import Qwen35MoeConfig
from openrecipes.models.qwen3_5_moe.model import Qwen35MoeForCausalLM, build_qwen3_5_moe

__all__ = ["Qwen35MoeConfig", "Qwen35MoeForCausalLM", "build_qwen3_5_moe"]
