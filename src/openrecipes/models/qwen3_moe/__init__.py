from openrecipes.models.qwen3_moe.config import Qwen3MoeConfig

__all__ = ["Qwen3MoeConfig"]
