"""The model families openrecipes knows, and their named configurations (values written in each family's package,
not downloaded). Adding a family is one new folder under models/ (see docs/adding-a-model.md) and one line here."""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

# one line per family: the module that declares its ``FAMILY``
FAMILY_MODULES = (
    "openrecipes.models.qwen3_moe.family",
    "openrecipes.models.muse_spark.family",
    "openrecipes.models.qwen3_vl_moe.family",
    "openrecipes.models.deepseek_v3.family",
    "openrecipes.models.glm4_moe.family",
    "openrecipes.models.gpt_oss.family",
    "openrecipes.models.qwen3_5_moe.family",
)


@lru_cache(maxsize=1)
def families() -> tuple[Any, ...]:
    declared = tuple(importlib.import_module(module).FAMILY for module in FAMILY_MODULES)
    seen: dict[str, str] = {}
    for family in declared:
        for name in family.named_configs:
            if name in seen:
                raise ValueError(f"model {name!r} is named by both {seen[name]} and {family.name}")
            seen[name] = family.name
    return declared


def _named() -> dict[str, Any]:
    return {name: factory for family in families() for name, factory in family.named_configs.items()}


def get_config(name: str) -> Any:
    named = _named()
    if name not in named:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(sorted(named))}")
    return named[name]()


def names() -> list[str]:
    return list(_named())
