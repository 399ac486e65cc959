"""Megatron-Core 0.16.1's own grouped expert linear layers (``TEGroupedLinear``,
``TEColumnParallelGroupedLinear``, ``TERowParallelGroupedLinear`` of
megatron/core/extensions/transformer_engine.py) built on a machine without Transformer Engine,
over a plain-torch stand-in for TE's ``GroupedLinear`` (test process only).

Megatron defines those classes only when TE imports; :func:`install` compiles Megatron's own
source block of them against a namespace whose ``te.pytorch.GroupedLinear`` is
:class:`StandInGroupedLinear` (TE 2.x's contract: ``num_gemms`` parameters ``weight{i}`` of shape
``[out, in]``, ``forward(x, m_splits)`` = ``cat(x_i @ weight{i}.T)`` over the row splits, an empty
uint8 ``_extra_state`` without FP8), and puts them where ``TESpecProvider.grouped_mlp_modules``
looks them up, so that ``TEGroupedMLP`` (unchanged) and its sharded state dict are Megatron's.
"""

from __future__ import annotations

import inspect
import textwrap
import types

import torch

_HEAD = 'if HAVE_TE and is_te_min_version("1.9.0.dev0"):\n'


class StandInGroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear`` on CPU without communication (expert TP 1 or explicit expert comm)."""

    def __init__(self, num_gemms, in_features, out_features, *, bias=True, return_bias=False,
                 init_method=None, params_dtype=torch.float32, device="cpu", tp_size=1, parallel_mode=None, **_):
        super().__init__()
        assert tp_size == 1, "the stand-in holds whole (expert-TP 1) weights"
        self.num_gemms, self.use_bias, self.return_bias = num_gemms, bias, return_bias
        self.fp8, self.fp8_calibration, self.fp8_meta = False, False, {"fp8_checkpoint": False}
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            if init_method is not None:
                init_method(w)
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.zeros(out_features, dtype=params_dtype, device=device)))

    def init_fp8_metadata(self, num_gemms=1):
        pass

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, x, m_splits, is_first_microbatch=None):
        outs = [torch.nn.functional.linear(xi, getattr(self, f"weight{i}"),
                                           getattr(self, f"bias{i}") if self.use_bias and not self.return_bias
                                           else None)
                for i, xi in enumerate(torch.split(x, list(m_splits)))]
        out = torch.cat(outs) if outs else x.new_zeros(0, getattr(self, "weight0").shape[0])
        if self.return_bias:
            return out, torch.stack([getattr(self, f"bias{i}") for i in range(self.num_gemms)])
        return out

    def backward_dw(self):
        pass


def install() -> tuple[type, type]:
    """Compile Megatron's TE grouped-linear classes over the stand-in and install them in
    ``transformer_engine_spec_provider`` (and ``extensions.transformer_engine``). Returns the
    (column, row) classes."""
    import megatron.core.extensions.transformer_engine as mte
    import megatron.core.extensions.transformer_engine_spec_provider as prov

    src = inspect.getsource(mte)
    start = src.index(_HEAD) + len(_HEAD)
    end = src.index("\nelse:\n", start)
    g = dict(vars(mte))
    g["te"] = types.SimpleNamespace(pytorch=types.SimpleNamespace(GroupedLinear=StandInGroupedLinear))
    g["is_te_min_version"] = lambda v, check_equality=True: True  # TE 2.x behaviour
    f = mte._get_extra_te_kwargs
    g["_get_extra_te_kwargs"] = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
    exec(compile(textwrap.dedent(src[start:end]), mte.__file__, "exec"), g)
    col, row = g["TEColumnParallelGroupedLinear"], g["TERowParallelGroupedLinear"]
    for m in (mte, prov):
        m.TEColumnParallelGroupedLinear, m.TERowParallelGroupedLinear = col, row
    mte.TEGroupedLinear = g["TEGroupedLinear"]
    return col, row
