"""Compat checks in a fresh process: what breaks before the mends, that each is applied
after, idempotence. Prints a JSON dict on the last line."""

from __future__ import annotations

import json

import torch


def raises(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return None


def main() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    r: dict = {}
    # still needed? (each should fail without the mend)
    r["before_te_general_gemm_defined"] = hasattr(moe_utils, "te_general_gemm")
    r["before_stream"] = raises(lambda: torch.cuda.Stream())
    r["before_current_device"] = raises(lambda: torch.cuda.current_device())
    r["before_zeros_cuda"] = raises(lambda: torch.zeros(1, device="cuda"))
    r["before_seed"] = raises(lambda: mrandom.model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0))
    r["before_recompute_rng"] = raises(lambda: mrandom._get_all_rng_states())  # activation recompute
    r["before_move_numpy"] = type(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__
    # mend 8: torch norm under sequence parallel (transformer/torch_norm.py asserts)
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def _tcfg(sp: bool):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                 sequence_parallel=sp, tensor_model_parallel_size=2 if sp else 1,
                                 use_cpu_initialization=True)

    r["before_norm_sp"] = raises(lambda: WrappedTorchNorm(_tcfg(True), 8, eps=1e-5))
    # mend 17: the legacy GroupedMLP needs the grouped_gemm CUDA package; mend 18: Megatron's
    # CheckpointWithoutOutput(fp8=False) takes fp8 on (``fp8 is not None``) and then needs TE
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    r["before_grouped_gemm"] = gg.grouped_gemm_is_available()
    r["before_jit_fuser"] = experts.jit_fuser.__name__
    r["before_cwo_fp8"] = mrandom.CheckpointWithoutOutput(fp8=False).fp8

    from moe_async import compat

    r["apply1"] = compat.apply_cpu_compat()
    r["apply2"] = compat.apply_cpu_compat()
    r["mends"] = compat.applied_mends()
    from torch.overrides import _get_current_function_mode_stack

    r["modes_on_stack"] = sum(isinstance(m, compat.CudaToCpuMode) for m in _get_current_function_mode_stack())
    from megatron.core.transformer.moe import token_dispatcher

    r["te_general_gemm"] = moe_utils.te_general_gemm is None
    from moe_async.compat.grouped_gemm import cpu_gmm_installed, gmm

    r["grouped_gemm"] = [gg.grouped_gemm_is_available(), gg.ops.gmm is gmm, cpu_gmm_installed(),
                         experts.jit_fuser.__name__]
    r["cwo_fp8"] = [mrandom.CheckpointWithoutOutput(fp8=False).fp8, mrandom.CheckpointWithoutOutput(fp8=True).fp8]
    # mend 19, Megatron imported first: its jit_fuser turned to noop_decorator for modules decorated
    # later; torch.compile leaves megatron.* functions eager and still wraps everyone else's
    from megatron.core import jit as mjit
    from megatron.core.utils import divide

    def _mine(x):
        return x + 1

    r["jit_late"] = [mjit.jit_fuser.__name__, torch.compile(divide) is divide, torch.compile(_mine) is _mine,
                     torch.compile(mode="default")(_mine) is _mine]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        pass
    r["stream_ok"] = torch.cuda.current_stream() == s or True
    r["current_device"] = str(torch.cuda.current_device())
    r["zeros_cuda_device"] = str(torch.zeros(1, device="cuda").device)
    r["tensor_cuda_int"] = str(torch.tensor([1.0], device=0).device)
    r["to_cuda"] = str(torch.ones(1).to("cuda").device) + "," + str(torch.ones(1).cuda().device)
    r["pin"] = torch.empty(2, pin_memory=True).is_pinned()
    r["type_name"] = torch.ones(1).type()
    r["type_name_bf16"] = torch.ones(1, dtype=torch.bfloat16).type()
    r["type_cast_ok"] = torch.ones(1).type(torch.float64).dtype == torch.float64
    r["move_numpy"] = type(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__
    r["move_numpy_utils"] = type(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__
    cfg_sp = _tcfg(True)
    n_sp = WrappedTorchNorm(cfg_sp, 8, eps=1e-5)
    n_plain = WrappedTorchNorm(_tcfg(False), 8, eps=1e-5)
    r["norm_sp_type"] = type(n_sp).__name__
    r["norm_sp_marked"] = [getattr(p, "sequence_parallel", None) for p in n_sp.parameters()]
    r["norm_plain_marked"] = [getattr(p, "sequence_parallel", None) for p in n_plain.parameters()]
    r["norm_sp_cfg_untouched"] = cfg_sp.sequence_parallel is True
    x = torch.randn(3, 8)
    r["norm_sp_same_math"] = bool(torch.equal(n_sp(x), n_plain(x)))

    # RNG tracker: needs parallel state (1 process gloo)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    ps.initialize_model_parallel()
    compat.model_parallel_manual_seed(7)
    tr = mrandom.get_cuda_rng_tracker()
    r["tracker_cls"] = type(tr).__name__
    outer = torch.get_rng_state()
    with tr.fork():
        a = torch.rand(3)
    r["fork_restores_outer"] = bool(torch.equal(outer, torch.get_rng_state()))
    with tr.fork():
        b = torch.rand(3)
    r["fork_advances"] = not torch.equal(a, b)
    compat.model_parallel_manual_seed(7)
    with mrandom.get_cuda_rng_tracker().fork():
        c = torch.rand(3)
    r["fork_reproducible"] = bool(torch.equal(a, c))
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    print(json.dumps(r))


if __name__ == "__main__":
    main()
