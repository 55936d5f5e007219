from openrecipes.models.gpt_oss.config import GptOssConfig
from openrecipes.models.gpt_oss.model import GptOssForCausalLM, build_gpt_oss

__all__ = ["GptOssConfig", "GptOssForCausalLM", "build_gpt_oss"]
