"""Layer-spec rewriting shared by the CPU core-attention stand-ins (``cp_attention.py``,
``thd_attention.py``): a local ``DotProductAttention`` class gets a mixin in front of it,
everywhere a layer or decoder-block spec names it. Only used without CUDA."""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any, TypeAlias, cast

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

#: A Megatron-Core layer spec or decoder block spec (what a model family's ``layer_spec`` returns).
LayerSpec: TypeAlias = "ModuleSpec | TransformerBlockSubmodules"


@functools.cache
def mixed_core_attention(mixin: type, base: type, prefix: str) -> type:
    """``class <prefix><base.__name__>(mixin, base)`` with ``mixin``'s docstring; cached, so
    one class per (mixin, base)."""
    return type(f"{prefix}{base.__name__}", (mixin, base), {"__doc__": mixin.__doc__})


def swap_core_attention(spec: LayerSpec, mixin: type, prefix: str) -> tuple[LayerSpec, int]:
    """A copy of the layer spec (or decoder block spec) ``spec`` in which every
    ``core_attention`` that is a local ``DotProductAttention`` (sub)class (bare or in a
    ``ModuleSpec``) is replaced by :func:`mixed_core_attention` ``(mixin, cls, prefix)``
    (classes that already have ``mixin`` are left); returns ``(copy, number replaced)``.
    The given spec is not changed."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    n = 0
    seen: set[int] = set()

    def swap(ca: Any) -> Any:  # a spec's core_attention: a class or a ModuleSpec
        nonlocal n
        if isinstance(ca, ModuleSpec):
            ca.module = swap(ca.module)
            return ca
        if isinstance(ca, type) and issubclass(ca, DotProductAttention) and not issubclass(ca, mixin):
            n += 1
            return mixed_core_attention(mixin, cast(type, ca), prefix)
        return ca

    def walk(x: Any) -> None:  # any object of a spec tree (Megatron's spec classes)
        if x is None or id(x) in seen or isinstance(x, (str, int, float, bool, type)):
            return
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
            return
        if hasattr(x, "core_attention"):
            x.core_attention = swap(x.core_attention)
        for name in ("submodules", "layer_specs", "self_attention", "cross_attention"):
            walk(getattr(x, name, None))

    walk(spec)
    return spec, n
