"""CPU compatibility layer for Megatron-Core 0.16.1 (the only place that patches libraries).

:func:`apply_cpu_compat` mends the few places where Megatron-Core assumes CUDA, so that the
same Megatron code path runs on CPU with gloo; nothing is patched when CUDA is available, and
every mend is idempotent (:func:`applied_mends` lists them). The list and the failures each
fixes: ``notes/megatron-cpu.md``.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "apply_cpu_compat",
    "applied_mends",
    "cpu_device_scope",
    "no_device_scope",
    "model_parallel_manual_seed",
    "CpuRNGStatesTracker",
    "CudaToCpuMode",
    "enable_cpu_wgrad_accumulation_fusion",
]

_LOCK = threading.Lock()
_APPLIED: list[str] = []


def applied_mends() -> list[str]:
    """Names of the mends applied in this process (empty with CUDA or before apply)."""
    return list(_APPLIED)


# ---------------------------------------------------------------------------------------
# Mend 4 (+10): device="cuda" in factories, Tensor.cuda(), pin_memory, Tensor.type() names.
# Answers: pipeline_parallel/schedules.py (total_num_tokens device="cuda"),
# transformer/moe/moe_utils.py (aux-loss tracker zeros on "cuda"), optimizer/optimizer.py
# (found_inf / _scale_one on "cuda"), optimizer/clip_grads.py (device='cuda' buffers and
# ``assert param.grad.type() == 'torch.cuda.FloatTensor'``), core/utils.py.
# ---------------------------------------------------------------------------------------
_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(d: object) -> bool:
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    # A bare int device means a CUDA ordinal in torch factory calls.
    return isinstance(d, int) and not isinstance(d, bool)


class CudaToCpuMode(TorchFunctionMode):
    """TorchFunctionMode that rewrites CUDA placement to CPU.

    * ``device=`` "cuda"/"cuda:N"/torch.device("cuda")/int -> ``cpu`` (factories, ``.to``);
    * positional CUDA device in ``Tensor.to`` -> ``cpu``;
    * ``pin_memory=True`` -> False; ``Tensor.pin_memory()`` and ``Tensor.cuda()`` -> identity;
    * ``Tensor.record_stream`` -> no-op;
    * ``Tensor.type()`` (no argument) on CPU float tensors reports the ``torch.cuda.*`` name
      that Megatron's optimizer/clip-grad type checks expect.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


def cpu_device_scope() -> contextlib.AbstractContextManager:
    """Context in which ``device="cuda"`` is rewritten to CPU (no-op with CUDA or when the
    mode is already active on this thread). The trainer wraps every public call in it, so
    calls from other threads (e.g. Ray's executor) are covered too."""
    if torch.cuda.is_available() or _mode_active():
        return contextlib.nullcontext()
    return CudaToCpuMode()


@contextlib.contextmanager
def no_device_scope():
    """Suspend :class:`CudaToCpuMode` (when it is the innermost torch function mode) for code
    that only moves CPU tensors and never names a CUDA device: the mode costs a Python call on
    every torch op and tensor attribute (``.shape``, ``.data_ptr()``), ~15k of them per
    conversion of a 4-layer MoE. No-op otherwise (CUDA, no mode, or another mode on top)."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], CudaToCpuMode):
        yield
        return
    with _pop_mode_temporarily():
        yield


# ---------------------------------------------------------------------------------------
# Mend 19: Megatron's ``jit_fuser`` is ``torch.compile``, applied when its modules are imported
# (core/fusions/*, transformer/moe/router.py, ...). Without CUDA each process paid ~3.7 s of CPU
# importing dynamo and inductor at the first decoration, and dynamo traced
# ``TopKRouter._apply_expert_bias`` on every router's first call. Installed when this module is
# imported (before Megatron's, in the trainer): ``torch.compile`` of a function defined in a
# ``megatron.*`` module returns it unchanged (Megatron's own ``noop_decorator``: the same ops,
# eager); every other caller gets torch's ``compile``.
# ---------------------------------------------------------------------------------------
_TORCH_COMPILE = torch.compile


def _compile_except_megatron(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` with torch's signature, except that a function or module defined in a
    ``megatron.*`` module comes back unchanged (eager). Decorator form (``model=None``) too."""
    if model is None:
        return lambda m: _compile_except_megatron(m, **kwargs)
    if str(getattr(model, "__module__", "") or "").startswith("megatron."):
        return model
    return _TORCH_COMPILE(model, **kwargs)


def _patch_megatron_jit_eager() -> None:
    """Mend 19 (idempotent); where ``megatron.core.jit`` was imported before this module, also
    Megatron's ``disable_jit_fuser`` for the modules it has not decorated yet."""
    torch.compile = _compile_except_megatron
    jit = sys.modules.get("megatron.core.jit")
    if jit is not None:
        jit.disable_jit_fuser()


# Mend 20: Megatron-Core imports wandb at module level when it is installed (core/timers.py, the
# inference engine and context), ~0.6 s of CPU in every trainer process, for writers this project
# never passes it. Without CUDA, an ``import wandb`` made by a ``megatron.*`` module's own code
# raises ImportError (Megatron's fallback: ``wandb = None``); every other importer gets wandb.
class _WandbHiddenFromMegatron(importlib.abc.MetaPathFinder):
    """``find_spec`` that refuses ``wandb`` to an import statement executed in a ``megatron.*``
    module (the first frame outside importlib); None (the next finder) for everything else."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname != "wandb":
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        if frame is not None and str(frame.f_globals.get("__name__", "")).startswith("megatron."):
            raise ImportError("wandb is not imported by Megatron-Core on CPU (moe_async.compat)")
        return None


def _hide_wandb_from_megatron() -> None:
    """Mend 20 (idempotent): the finder first on ``sys.meta_path``."""
    if not any(isinstance(f, _WandbHiddenFromMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _WandbHiddenFromMegatron())


if not torch.cuda.is_available():
    _patch_megatron_jit_eager()
    _hide_wandb_from_megatron()


# ---------------------------------------------------------------------------------------
# Mend 1: RNG tracker. Answers tensor_parallel/random.py (model_parallel_cuda_manual_seed
# and CudaRNGStatesTracker use torch.cuda RNG state; attention dropout forks it).
# ---------------------------------------------------------------------------------------
def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker with CPU generator states (same names, same semantics)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


CpuRNGStatesTracker: Any = None  # set by apply_cpu_compat (needs megatron imported)


def model_parallel_manual_seed(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker (data-parallel, tensor-parallel, expert-parallel
    states with Megatron's offsets). With CUDA this is ``model_parallel_cuda_manual_seed``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return
    apply_cpu_compat()
    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank
    )


# ---------------------------------------------------------------------------------------
# Mend 2: CUDA streams/events. Answers transformer/moe/token_dispatcher.py
# (MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream(), torch.cuda.stream()).
# ---------------------------------------------------------------------------------------
class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` measures wall time in ms."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


_CPU_STREAM = _CpuStream()


def _patch_cuda_streams() -> None:
    # setattr: the replacements do not have torch's signatures (that is the point)
    setattr(torch.cuda, "Stream", _CpuStream)
    setattr(torch.cuda, "Event", _CpuEvent)
    setattr(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    setattr(torch.cuda, "current_stream", lambda device=None: _CPU_STREAM)
    setattr(torch.cuda, "default_stream", lambda device=None: _CPU_STREAM)
    setattr(torch.cuda, "synchronize", lambda device=None: None)


# ---------------------------------------------------------------------------------------
# Mend 3: torch.cuda.current_device(). Answers models/common/embeddings/
# rotary_pos_embedding.py, core/utils.py (GlobalMemoryBuffer), transformer/moe/router.py,
# tensor_parallel/mappings.py, pipeline_parallel/p2p_communication.py, dist_checkpointing.
# ---------------------------------------------------------------------------------------
def _patch_current_device() -> None:
    setattr(torch.cuda, "current_device", lambda: _CPU)


# ---------------------------------------------------------------------------------------
# Mend 5: ``NameError: te_general_gemm`` in transformer/moe/moe_utils.py (router gating
# references it unconditionally when Transformer Engine is absent).
# ---------------------------------------------------------------------------------------
def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ---------------------------------------------------------------------------------------
# Mend 7: EP>1, ``all_to_all_single`` needs split sizes as lists, but
# transformer/moe/moe_utils.py::maybe_move_tensor_to_cpu leaves CPU tensors as tensors
# (token_dispatcher.py imports it by name, so both modules are patched).
# ---------------------------------------------------------------------------------------
def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.detach().to("cpu")
        if as_numpy:
            return tensor.numpy()
    return tensor


def _patch_maybe_move_tensor_to_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------------------
# Mend 8: TP>1 with MoE demands sequence parallel, and transformer/torch_norm.py
# (WrappedTorchNorm, the local spec's norm without Apex) asserts ``not
# config.sequence_parallel``. Under sequence parallelism a norm sees only this rank's
# sequence shard, so its weight gradient is partial; Megatron sums such gradients over TP
# in distributed/finalize_model_grads.py for params marked ``sequence_parallel``. The mend
# builds the same torch norm (from a copy of the config with sequence_parallel off) and
# marks its params ``sequence_parallel = True`` so that reduction happens.
# ---------------------------------------------------------------------------------------
def _patch_torch_norm_sequence_parallel() -> None:
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_moe_async_sp_mend", False):
        return
    orig_new = cls.__new__

    def __new__(klass, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return orig_new(klass, config, hidden_size, *args, **kwargs)
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = orig_new(klass, cfg, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)
    cls._moe_async_sp_mend = True


# ---------------------------------------------------------------------------------------
# Mend 9: expert tensor parallelism (ETP > 1). Answers tensor_parallel/mappings.py
# ``_gather_along_first_dim(input_, group, output_split_sizes)``: with split sizes it calls
# ``torch.distributed.all_gather(list(torch.split(output, output_split_sizes)), input_)``,
# i.e. per-rank tensors of different first-dim sizes, which ProcessGroupGloo refuses
# ("ProcessGroupGloo::allgather: invalid tensor size at index 1"). The alltoall MoE dispatcher
# makes exactly that call with ETP > 1 (transformer/moe/token_dispatcher.py,
# dispatch_postprocess: the tokens and probs each expert-TP rank received, gathered over the
# expert-TP group; the combine side's backward gathers the gradient the same way). The mend
# pads every rank's part to the largest size, gathers the equal-size parts with
# ``all_gather_into_tensor`` (the call the equal-split branch already makes) and drops the
# padding rows: the same values, bit for bit, in the same order. Equal or absent split sizes
# take Megatron's own code. The backward's uneven reduce-scatter
# (``_reduce_scatter_along_first_dim(..., input_split_sizes)``,
# ``torch.distributed.reduce_scatter`` of a list of tensors of different sizes) runs on gloo
# as it is in torch 2.13 (tests/compat checks that it does, with exact sums).
# ---------------------------------------------------------------------------------------
def _patch_uneven_first_dim_gather() -> None:
    from megatron.core.tensor_parallel import mappings

    orig = mappings._gather_along_first_dim
    if getattr(orig, "_moe_async_uneven_mend", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        if len(set(sizes)) == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        world, me, m = group.size(), group.rank(), max(sizes)
        if len(sizes) != world or input_.shape[0] != sizes[me]:
            raise ValueError(f"uneven all-gather: rank {me} of {world} holds {input_.shape[0]} rows, "
                             f"output_split_sizes={sizes}")
        rest = tuple(input_.shape[1:])
        padded = input_.new_zeros((m, *rest))
        padded[: sizes[me]] = input_
        gathered = torch.empty((world * m, *rest), dtype=input_.dtype, device=input_.device)
        torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * m : r * m + s] for r, s in enumerate(sizes)], dim=0)

    _gather_along_first_dim._moe_async_uneven_mend = True  # type: ignore[attr-defined]
    _gather_along_first_dim.__wrapped__ = orig  # type: ignore[attr-defined]
    mappings._gather_along_first_dim = _gather_along_first_dim


# ---------------------------------------------------------------------------------------
# Mend 12 (speed, opt-in): weight-gradient accumulation fusion. Answers
# tensor_parallel/layers.py, which with ``gradient_accumulation_fusion=True`` calls Apex's
# CUDA extension ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output,
# main_grad)`` (``main_grad += grad_output^T @ input``) and refuses to build a linear layer
# when that extension is absent. Without it every linear layer's backward allocates a
# weight-gradient tensor per micro-batch and DDP's hook adds it to ``main_grad`` in a second
# pass (distributed_data_parallel.py). The stand-in does the same accumulation with one
# in-place GEMM (``addmm_``, BLAS beta=1). Applied only by
# :func:`enable_cpu_wgrad_accumulation_fusion` (the trainer calls it on CPU).
# ---------------------------------------------------------------------------------------
class _CpuFusedWeightGradient:
    """CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (same signatures).

    ``total_input [T, in]``, ``grad_output [T, out]``, ``main_grad [out, in]`` (fp32, or
    bf16/fp16 for the ``_fp16`` variant); ``main_grad += grad_output^T @ total_input``.
    Mixed dtypes (bf16 activations, fp32 main_grad) take the unfused numerics: the GEMM in
    the activation dtype, then an fp32 add, as Megatron's unfused path does."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if total_input.dtype == grad_output.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def enable_cpu_wgrad_accumulation_fusion() -> bool:
    """Make ``TransformerConfig(gradient_accumulation_fusion=True)`` work on CPU (mend 12).
    Returns True when the stand-in is in place (False, changing nothing, with CUDA)."""
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import layers

    with _LOCK:
        if not getattr(layers, "_grad_accum_fusion_available", False) or not hasattr(
            layers, "fused_weight_gradient_mlp_cuda"
        ):
            layers.fused_weight_gradient_mlp_cuda = _CpuFusedWeightGradient
            layers._grad_accum_fusion_available = True
        if "wgrad_accumulation_fusion" not in _APPLIED:
            _APPLIED.append("wgrad_accumulation_fusion")
    return True


# ---------------------------------------------------------------------------------------
# Mend 15: activation recompute (full, and the selective modules that use Megatron's
# CheckpointFunction). Answers tensor_parallel/random.py (_get_all_rng_states /
# _set_all_rng_states read and restore torch.cuda's RNG state around the recomputed forward).
# Without CUDA there is no CUDA generator: the CPU generator and the tracker's (CPU) states are
# what the recompute must restore, and random.py saves and restores both itself.
# ---------------------------------------------------------------------------------------
def _patch_recompute_rng_state() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def _get_cuda_rng_state(device: str | int | torch.device = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # no CUDA generator to save

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        return None  # nothing to restore: the CPU state is restored by torch.set_rng_state

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state


# ---------------------------------------------------------------------------------------
# Mend 18: ``CheckpointWithoutOutput`` (selective recompute of 'moe_act' in the grouped expert
# MLP, and the other modules that discard their output) without Transformer Engine. Answers
# tensor_parallel/random.py: ``__init__(fp8=False)`` sets ``self.fp8 = fp8 is not None`` (True
# for False), so its forward calls TE's ``FP8GlobalStateManager`` and
# ``activation_recompute_forward``, which are undefined without TE (NameError). Without TE
# there is no FP8: the object keeps ``fp8=False`` and the non-FP8 branches (Megatron's own) run.
# ---------------------------------------------------------------------------------------
def _patch_checkpoint_without_output_fp8() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    if getattr(mrandom, "HAVE_TE", True) or getattr(cls, "_moe_async_fp8_mend", False):
        return
    orig_init = cls.__init__

    def __init__(self, fp8: object = False) -> None:
        orig_init(self, fp8)
        self.fp8 = bool(fp8)  # no TE: no FP8 (False or None alike)

    cls.__init__ = __init__
    cls._moe_async_fp8_mend = True


def apply_cpu_compat() -> bool:
    """Apply every CPU mend once (idempotent). Returns True when the mends are active,
    False (and changes nothing) when CUDA is available.

    Also pushes :class:`CudaToCpuMode` on the calling thread; code running on other threads
    should enter :func:`cpu_device_scope` (the trainer does so in every public method).
    """
    global CpuRNGStatesTracker
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _APPLIED:
            CpuRNGStatesTracker = _make_cpu_tracker_class()
            _APPLIED.append("rng_tracker")  # tensor_parallel/random.py
            _patch_cuda_streams()
            _APPLIED.append("cuda_streams")  # transformer/moe/token_dispatcher.py
            _patch_current_device()
            _APPLIED.append("current_device")  # rotary_pos_embedding.py, utils.py, router.py
            _patch_te_general_gemm()
            _APPLIED.append("te_general_gemm")  # transformer/moe/moe_utils.py
            _patch_maybe_move_tensor_to_cpu()
            _APPLIED.append("maybe_move_tensor_to_cpu")  # moe_utils.py, token_dispatcher.py
            _patch_torch_norm_sequence_parallel()
            _APPLIED.append("torch_norm_sequence_parallel")  # transformer/torch_norm.py
            _patch_uneven_first_dim_gather()
            _APPLIED.append("uneven_first_dim_gather")  # tensor_parallel/mappings.py (ETP > 1)
            _patch_recompute_rng_state()
            _APPLIED.append("recompute_rng_state")  # tensor_parallel/random.py (activation recompute)
            _patch_checkpoint_without_output_fp8()
            _APPLIED.append("checkpoint_without_output_fp8")  # tensor_parallel/random.py (moe_act recompute)
            from moe_async.compat.hybrid_offload import patch_hybrid_device_optimizer

            if patch_hybrid_device_optimizer():  # optimizer/cpu_offloading/hybrid_optimizer.py
                _APPLIED.append("hybrid_device_optimizer")
            from moe_async.compat.dist_opt_step import patch_dist_opt_torch_adam_step

            if patch_dist_opt_torch_adam_step():  # optimizer/distrib_optimizer.py (torch Adam's step)
                _APPLIED.append("dist_opt_torch_adam_step")
            from moe_async.compat.grouped_gemm import patch_grouped_mlp

            if patch_grouped_mlp():  # transformer/moe/grouped_gemm_util.py, experts.py (GroupedMLP)
                _APPLIED.append("grouped_gemm")
            _patch_megatron_jit_eager()
            _APPLIED.append("megatron_jit_eager")  # core/jit.py: jit_fuser (torch.compile) users
            _hide_wandb_from_megatron()
            _APPLIED.append("megatron_without_wandb")  # core/timers.py, inference/: optional wandb
            _APPLIED.append("cuda_to_cpu_mode")  # schedules.py, optimizer.py, clip_grads.py
        if not _mode_active():
            CudaToCpuMode().__enter__()
    return True
