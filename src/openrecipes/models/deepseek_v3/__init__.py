from openrecipes.models.deepseek_v3.config import DeepseekV3Config
from openrecipes.models.deepseek_v3.model import DeepseekV3ForCausalLM, build_deepseek_v3

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "build_deepseek_v3"]
