"""RoPE of an HF config: plain RoPE or YaRN, read into the fields Megatron-Core takes.

Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` and ``rope_theta``; YaRN is mapped
to Megatron's YaRN embedding with the same blended frequencies and attention factor as
transformers. A RoPE type or YaRN setting Megatron cannot reproduce raises ``ValueError`` naming
the field.

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from moe_async.types import JsonDict

#: RoPE types a family can accept (HF ``rope_type``); ``default`` is plain RoPE
ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` (1.0 for ``scale <= 1``): transformers' and
    Megatron-Core's ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Rope:
    """RoPE of a model: ``rope_type`` "default" (plain, ``theta`` only) or "yarn".

    YaRN fields are HF's (``factor``: context extension ratio; ``original_max_position_embeddings``:
    pre-training length; ``beta_fast``/``beta_slow``: ramp bounds in rotations; ``mscale``,
    ``mscale_all_dim``: as in the config, None when absent)."""

    rope_type: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def is_yarn(self) -> bool:
        return self.rope_type == "yarn"

    @property
    def attention_factor(self) -> float:
        """transformers' cos/sin factor (1.0 for plain RoPE)."""
        if not self.is_yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor DeepSeek-style attention multiplies its softmax scale by:
        ``get_mscale(factor, mscale_all_dim)^2`` (1.0 without YaRN or ``mscale_all_dim``)."""
        if not self.is_yarn or not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2

    def megatron_yarn(self) -> dict[str, float | int | str | None]:
        """``MLATransformerConfig`` fields: ``rope_type``, ``rotary_base``,
        ``rotary_scaling_factor``, ``mscale``, ``mscale_all_dim`` (and for YaRN
        ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``). Megatron's cos/sin
        factor ``get_mscale(f, mscale)/get_mscale(f, mscale_all_dim)`` equals
        :attr:`attention_factor` and its softmax factor ``get_mscale(f, mscale_all_dim)^2``
        equals :attr:`softmax_mscale` (:func:`read_rope` refuses the configs where no choice
        does)."""
        if not self.is_yarn:
            return dict(rope_type="rope", rotary_base=self.theta, rotary_scaling_factor=1.0, mscale=1.0,
                        mscale_all_dim=0.0)
        ms, ms_all = self.mscale or 0.0, self.mscale_all_dim or 0.0
        both = bool(ms and ms_all)
        return dict(
            rope_type="yarn", rotary_base=self.theta, rotary_scaling_factor=self.factor,
            # both set: HF's own ratio; else HF's factor is get_mscale(f) = get_mscale(f, 1) / get_mscale(f, 0)
            mscale=float(ms) if both else 1.0,
            mscale_all_dim=float(ms_all) if both else 0.0,
            original_max_position_embeddings=self.original_max_position_embeddings,
            beta_fast=self.beta_fast, beta_slow=self.beta_slow,
        )

    def gpt_yarn_config(self) -> dict[str, float | int | str | bool | None]:
        """The ``yarn_*`` attributes ``GPTModel(position_embedding_type="yarn")`` reads from its
        config (GQA attention; Megatron's cos/sin factor and the attention's ``mscale`` come
        from the same fields as :meth:`megatron_yarn`'s)."""
        m = self.megatron_yarn()
        return dict(yarn_rotary_scaling_factor=m["rotary_scaling_factor"],
                    yarn_original_max_position_embeddings=m["original_max_position_embeddings"],
                    yarn_beta_fast=m["beta_fast"], yarn_beta_slow=m["beta_slow"], yarn_mscale=m["mscale"],
                    yarn_mscale_all_dim=m["mscale_all_dim"], yarn_correction_range_round_to_int=True)

    def describe(self) -> str:
        """One line: ``rope (theta 10000)`` or ``yarn (factor 40, ..., softmax x1.874)``."""
        if not self.is_yarn:
            return f"rope (theta {self.theta:g})"
        return (f"yarn (theta {self.theta:g}, factor {self.factor:g} over {self.original_max_position_embeddings} "
                f"positions, beta {self.beta_fast:g}/{self.beta_slow:g}, cos/sin x{self.attention_factor:.4g}, "
                f"softmax x{self.softmax_mscale:.4g})")


def rope_fields(d: JsonDict) -> tuple[str, JsonDict]:
    """``(where, fields)``: the RoPE dict of HF config dict ``d`` and its field name
    (``rope_parameters`` or ``rope_scaling``); ``("", {})`` when neither is set. A
    transformers-5 ``rope_parameters`` keyed by layer type is not supported (ValueError)."""
    for where in ("rope_parameters", "rope_scaling"):
        rp = d.get(where)
        if rp:
            if not isinstance(rp, Mapping):
                raise ValueError(f"HF config field {where}={rp!r}: expected a dict")
            return where, dict(rp)
    return "", {}


def read_rope(d: JsonDict, supported: tuple[str, ...] = ("default",)) -> Rope:
    """The :class:`Rope` of HF config dict ``d``.

    Args:
        supported: the ``rope_type`` values the caller's family implements (a subset of
            :data:`ROPE_TYPES`).

    Raises:
        ValueError: naming the field: no ``rope_theta``; a ``rope_type`` not in ``supported``;
            for YaRN, no ``factor`` or ``original_max_position_embeddings``, ``truncate``
            false, ``partial_rotary_factor`` != 1, an ``attention_factor`` other than the one
            derived from ``factor``/``mscale``/``mscale_all_dim``, or ``mscale_all_dim`` set
            without ``mscale`` (Megatron-Core's YaRN cannot reproduce these).
    """
    where, rp = rope_fields(d)
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rtype not in supported:
        raise ValueError(f"unsupported HF config field {where or 'rope_parameters'}.rope_type={rtype!r} for "
                         f"model_type={d.get('model_type')!r} (supported: {', '.join(supported)})")
    theta = rp.get("rope_theta", d.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config has neither rope_parameters.rope_theta nor rope_theta")
    if rtype == "default":
        return Rope("default", float(theta))
    for key in ("factor", "original_max_position_embeddings"):
        if rp.get(key) is None:
            raise ValueError(f"HF config field {where}.{key} is required for rope_type 'yarn'")
    if rp.get("truncate", True) is not True:
        raise ValueError(f"unsupported HF config field {where}.truncate={rp['truncate']!r} (supported: true; "
                         "Megatron-Core's YaRN rounds the correction range to integers)")
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"unsupported HF config field {where}.partial_rotary_factor={prf!r} with YaRN (supported: 1)")
    rope = Rope("yarn", float(theta), factor=float(rp["factor"]),
                original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
                beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"))
    if rope.mscale_all_dim and not rope.mscale and rope.factor > 1:
        raise ValueError(f"unsupported HF config fields {where}.mscale_all_dim={rope.mscale_all_dim!r} without "
                         f"{where}.mscale: Megatron-Core's YaRN cannot give cos/sin x{rope.attention_factor:.6g} "
                         "together with that softmax scale; set mscale")
    af = rp.get("attention_factor")
    if af is not None and float(af) != rope.attention_factor:
        raise ValueError(f"unsupported HF config field {where}.attention_factor={af!r}: Megatron-Core's YaRN "
                         f"derives it from factor/mscale/mscale_all_dim ({rope.attention_factor!r})")
    return rope
