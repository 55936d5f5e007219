"""The base of every recipe section: a number field takes a number, never a boolean.

pydantic's lax mode reads ``true`` as 1 where an integer is expected (and as 1.0 for a float), so ``steps: true`` or
``--set layout.tp=true`` would train one step or one rank without a word. Sections inheriting ``NumbersNotBooleans``
refuse a boolean given for a field that takes no boolean, naming the field as pydantic's own errors do.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator


def _takes_booleans(annotation: Any) -> bool:
    """Whether a field of this annotation accepts a boolean as one (bool itself, StrictBool, Any, or a union or
    container holding either)."""
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return _takes_booleans(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_booleans(arg) for arg in typing.get_args(annotation))
    return annotation not in (int, float, type(None))


class NumbersNotBooleans(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and not _takes_booleans(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value
