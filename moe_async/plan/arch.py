"""Parameter counts of an MoE decoder from its HF config fields (no weights), and its RoPE row.

Counts in elements per family (``qwen3_moe``, ``mixtral``, ``deepseek_v3``, ``glm4_moe``,
``llama``), split into dense and expert parameters per layer, as transformers builds the model;
an unknown ``model_type`` or a missing field raises :class:`ArchError` naming it.

Design notes: ``docs/design/plan.md``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_async.types import JsonDict


class ArchError(ValueError):
    """An HF architecture field is missing or invalid; the message names source and field."""


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters (elements), by how Megatron shards them.

    ``attn_tp``: split over TP (q/o projections; MLA's up-projections); ``attn_kv``: k/v
    projections (split over TP in Megatron; SGLang replicates them when its TP exceeds the KV
    heads); ``mlp_tp``: a dense MLP or shared experts (split over TP); ``replicated``: held whole
    by every TP rank (norms, router, router bias, MLA's down-projections); ``expert``: the
    routed experts, all of them (split over EP x ETP).
    """

    attn_tp: int
    attn_kv: int
    mlp_tp: int
    replicated: int
    expert: int
    moe: bool

    @property
    def total(self) -> int:
        return self.attn_tp + self.attn_kv + self.mlp_tp + self.replicated + self.expert


@dataclass(frozen=True)
class ModelShape:
    """An MoE decoder's sizes and parameter counts (elements), read by :func:`model_shape`.

    ``act_*`` are the per-token widths the activation estimate uses (moe_async/plan/memory.py);
    ``kv_cache_per_token_layer`` is the elements one token's KV cache holds per layer in one
    unsharded engine (GQA: 2 ng d; MLA: the latent rkv + dr, as SGLang caches it).
    """

    model_type: str
    source: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None  # None: MLA (no KV groups)
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int | None
    shared_intermediate_size: int
    layers: tuple[LayerParams, ...]
    embedding: int
    output: int
    final_norm: int
    tied: bool
    act_attn: int  # per-token widths stored by attention, split over TP heads: q + k + v + its output
    kv_cache_per_token_layer: int
    act_attn_whole: int = 0  # per-token widths every TP rank computes whole (MLA's latents)
    v_head_dim: int = 0  # MLA's value head width (its o projection takes num_attention_heads x it); 0: GQA
    rope: str = ""  # the RoPE read from the config (type and YaRN scaling), one line
    not_counted: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        """All parameters the trainer holds (HF vocab, no padding)."""
        return self.embedding + self.output + self.final_norm + sum(lp.total for lp in self.layers)

    @property
    def expert_total(self) -> int:
        """Routed-expert parameters."""
        return sum(lp.expert for lp in self.layers)

    @property
    def active(self) -> int:
        """Parameters one token passes through: all but the routed experts, plus top_k / E of them."""
        return self.total - self.expert_total + self.expert_total * self.top_k // max(self.num_experts, 1)

    @property
    def num_moe_layers(self) -> int:
        return sum(lp.moe for lp in self.layers)


class _Fields:
    """Typed reads of HF config fields; errors name ``<source>.<field>`` (or ``<source>: field``)."""

    def __init__(self, d: JsonDict, source: str):
        self.d, self.source = d, source

    def _name(self, key: str) -> str:
        return f"{self.source}.{key}" if self.source.startswith("model.arch") else f"{self.source}: {key}"

    def int(self, key: str, default: Any = ..., *, minimum: int = 1) -> Any:
        if key not in self.d or self.d[key] is None:
            if default is ...:
                raise ArchError(f"{self._name(key)} is required (the HF config field) for model_type="
                                f"{self.d.get('model_type')!r}")
            return default
        v = self.d[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ArchError(f"{self._name(key)}={v!r}: must be an integer >= {minimum}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.d.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ArchError(f"{self._name(key)}={v!r}: must be true or false")
        return v


def _gqa(f: _Fields, *, qk_norm: bool, bias: bool) -> tuple[int, int, int, int, int, int, int]:
    """GQA attention of one layer: (attn_tp, attn_kv, norms, nh, ng, d, act width)."""
    h, nh = f.int("hidden_size"), f.int("num_attention_heads")
    ng = f.int("num_key_value_heads", nh)
    if nh % ng:
        raise ArchError(f"{f._name('num_attention_heads')}={nh} is not a multiple of num_key_value_heads={ng}")
    d = f.int("head_dim", None) or h // nh
    q, kv = nh * d, ng * d
    attn_tp = 2 * h * q + (q if bias else 0)
    attn_kv = 2 * h * kv + (2 * kv if bias else 0)
    norms = 2 * h + (2 * d if qk_norm else 0)
    return attn_tp, attn_kv, norms, nh, ng, d, 2 * q + 2 * kv


def _mla(f: _Fields) -> tuple[int, int, int, int, int, int]:
    """DeepSeek-V3 MLA attention of one layer: (attn_tp, replicated, act width split over TP heads, act
    width of the latents every TP rank computes whole, kv cache per token, v_head_dim)."""
    h, nh = f.int("hidden_size"), f.int("num_attention_heads")
    rq = f.int("q_lora_rank", None)
    rkv, dn, dr, dv = (f.int("kv_lora_rank"), f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim"),
                       f.int("v_head_dim"))
    qd = nh * (dn + dr)
    if rq:
        up, down = rq * qd, h * rq + rq  # q_b (TP) ; q_a + q_a_layernorm (replicated)
    else:
        up, down = h * qd, 0
    up += rkv * nh * (dn + dv) + nh * dv * h  # kv_b, o_proj
    down += h * (rkv + dr) + rkv + 2 * h  # kv_a_proj_with_mqa, kv_a_layernorm, the two layer norms
    act = 2 * qd + 2 * nh * dv  # q and k, v and the attention output (split over TP heads)
    return up, down, act, (rq or 0) + rkv + dr, rkv + dr, dv  # latents: on every TP rank


def _moe_layers(f: _Fields, n_layers: int, is_moe, attn: tuple[int, int, int], *, experts: int, i_moe: int,
                router_bias: bool, shared: int) -> tuple[LayerParams, ...]:
    """Layers with ``attn = (attn_tp, attn_kv, replicated)``; MoE layers (``experts`` routed experts of
    FFN width ``i_moe``, a router, ``shared`` shared-expert width) where ``is_moe(i)``, else a dense MLP of
    ``intermediate_size``."""
    h, e = f.int("hidden_size"), experts
    out = []
    for i in range(n_layers):
        a_tp, a_kv, rep = attn
        if is_moe(i):
            out.append(LayerParams(a_tp, a_kv, 3 * h * shared, rep + e * h + (e if router_bias else 0),
                                   e * 3 * h * i_moe, True))
        else:
            out.append(LayerParams(a_tp, a_kv, 3 * h * f.int("intermediate_size"), rep, 0, False))
    return tuple(out)


SUPPORTED = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")


def model_shape(d: JsonDict, source: str) -> ModelShape:
    """The :class:`ModelShape` of HF config fields ``d`` (a config.json's dict).

    Args:
        d: the fields; ``model_type`` one of :data:`SUPPORTED`.
        source: where they came from, for messages (``model.arch`` or a config.json path).

    Raises:
        ArchError: unknown ``model_type``, or a required field missing / not a positive integer,
            naming ``source`` and the field.
    """
    mt = d.get("model_type")
    if mt not in SUPPORTED:
        raise ArchError(f"{source}: model_type={mt!r} is not one plan counts; supported: {list(SUPPORTED)}")
    f = _Fields(d, source)
    h, n_layers, vocab = f.int("hidden_size"), f.int("num_hidden_layers"), f.int("vocab_size")
    tied = f.bool("tie_word_embeddings", False)
    not_counted: list[str] = []
    act_whole = dv = 0
    if mt in ("qwen3_moe", "mixtral"):
        experts = f.int("num_local_experts" if mt == "mixtral" else "num_experts")
        i_moe = f.int("intermediate_size" if mt == "mixtral" else "moe_intermediate_size")  # Mixtral: one width
        top_k = f.int("num_experts_per_tok")
        a_tp, a_kv, norms, nh, ng, hd, act = _gqa(f, qk_norm=mt == "qwen3_moe", bias=f.bool("attention_bias", False))
        is_moe = lambda i: True  # noqa: E731
        if mt == "qwen3_moe":
            step = f.int("decoder_sparse_step", 1)
            only = d.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(x, int) for x in only):
                raise ArchError(f"{f._name('mlp_only_layers')}={only!r}: must be a list of layer indices")
            is_moe = lambda i: i not in only and (i + 1) % step == 0  # noqa: E731
        layers = _moe_layers(f, n_layers, is_moe, (a_tp, a_kv, norms), experts=experts, i_moe=i_moe,
                             router_bias=False, shared=0)
        shared_i, kv_cache = 0, 2 * ng * hd
    else:  # deepseek_v3, glm4_moe: first_k_dense_replace dense layers, shared experts, router bias
        experts, i_moe, top_k = f.int("n_routed_experts"), f.int("moe_intermediate_size"), f.int("num_experts_per_tok")
        first_dense = f.int("first_k_dense_replace", 0, minimum=0)
        shared_i = f.int("n_shared_experts", 0, minimum=0) * i_moe
        if mt == "deepseek_v3":
            a_tp, rep, act, act_whole, kv_cache, dv = _mla(f)
            a_kv, nh, ng = 0, f.int("num_attention_heads"), None
            freq = f.int("moe_layer_freq", 1)
            is_moe = lambda i: i >= first_dense and i % freq == 0  # noqa: E731
        else:
            a_tp, a_kv, rep, nh, ng, hd, act = _gqa(f, qk_norm=f.bool("use_qk_norm", False),
                                                    bias=f.bool("attention_bias", False))
            kv_cache = 2 * ng * hd
            is_moe = lambda i: i >= first_dense  # noqa: E731
        layers = _moe_layers(f, n_layers, is_moe, (a_tp, a_kv, rep), experts=experts, i_moe=i_moe,
                             router_bias=True, shared=shared_i)
        if f.int("num_nextn_predict_layers", 0, minimum=0):
            not_counted.append(f"{d['num_nextn_predict_layers']} MTP layer(s) (num_nextn_predict_layers): the "
                               "trainer builds no MTP head")
    if top_k > experts:
        raise ArchError(f"{f._name('num_experts_per_tok')}={top_k} exceeds the {experts} experts")
    dense_i = d.get("intermediate_size") if any(not lp.moe for lp in layers) else None
    return ModelShape(
        model_type=mt, source=source, vocab_size=vocab, hidden_size=h, num_layers=n_layers,
        num_attention_heads=nh, num_key_value_heads=ng, num_experts=experts, top_k=top_k,
        moe_intermediate_size=i_moe, dense_intermediate_size=dense_i,
        shared_intermediate_size=shared_i, layers=layers, embedding=vocab * h, output=0 if tied else vocab * h,
        final_norm=h, tied=tied, act_attn=act, act_attn_whole=act_whole, kv_cache_per_token_layer=kv_cache,
        v_head_dim=dv, not_counted=tuple(not_counted), rope=rope_row(d))


def rope_row(d: JsonDict) -> str:
    """The RoPE of HF config fields ``d`` in one line (:meth:`moe_async.models.rope.Rope.describe`:
    ``rope (theta ...)`` or ``yarn (factor ..., softmax x...)``); ``rope_theta not given`` when
    the fields leave it out; the reader's message for a RoPE no family implements."""
    from moe_async.models.rope import ROPE_TYPES, read_rope, rope_fields  # imports torch (the package)

    where, rp = rope_fields(d)
    if "rope_theta" not in rp and d.get("rope_theta") is None:
        rtype = rp.get("rope_type", rp.get("type", "default"))
        return f"{'rope' if rtype == 'default' else rtype} (rope_theta not given)"
    try:
        return read_rope(d, ROPE_TYPES).describe()
    except ValueError as e:
        return f"not supported: {e}"
