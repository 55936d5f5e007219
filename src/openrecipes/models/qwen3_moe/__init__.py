from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig
from openrecipes.models.qwen3_moe.model import Qwen3MoeForCausalLM, build_qwen3_moe

__all__ = ["Qwen3MoeConfig", "Qwen3MoeForCausalLM", "build_qwen3_moe"]
