from openrecipes.models.glm4_moe.config import Glm4MoeConfig
from openrecipes.models.glm4_moe.model import Glm4MoeForCausalLM, build_glm4_moe

__all__ = ["Glm4MoeConfig", "Glm4MoeForCausalLM", "build_glm4_moe"]
