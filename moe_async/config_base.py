"""The base of every config section: unknown keys, inf/nan and booleans given for numbers are
errors that name the field.

YAML reads ``true``/``false`` as booleans and pydantic's lax mode turns them into ``1``/``0``
for ``int`` and ``float`` fields, so ``trainer.lr=true`` would train at lr 1.0. A field whose
type is a number (``int``, ``float``, or an optional/union of them without ``bool``) refuses a
boolean value with a ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, Strict, model_validator


def _numeric(annotation: object) -> bool:
    """True when ``annotation`` is ``int``/``float`` (or a Union/Optional of them) and admits no
    ``bool``; ``Annotated`` forms are unwrapped, strict ones (``StrictInt``) left to pydantic."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # StrictInt & co: pydantic's own error names the field
        base, *meta = typing.get_args(annotation)
        return not any(isinstance(m, Strict) for m in meta) and _numeric(base)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return any(_numeric(a) for a in args) and bool not in args
    return annotation in (int, float)


class ConfigModel(BaseModel):
    """``extra="forbid"``, ``allow_inf_nan=False``, and no boolean where a number belongs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_bool_numbers(cls, data: object) -> object:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if any(isinstance(m, Strict) for m in field.metadata):
                    continue  # StrictInt & co: pydantic's own error names the field
                for key in {name, field.alias} - {None}:
                    if isinstance(data.get(key), bool) and _numeric(field.annotation):
                        raise ValueError(f"{key}={data[key]!r} is a boolean; {key} takes a number")
        return data
