"""torch_dist checkpoints of :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`.

:class:`Checkpointer` (over the trainer's :class:`~moe_async.trainer.state.TrainerState`):
:meth:`Checkpointer.save` / :meth:`Checkpointer.load` (model, distributed-optimizer state in Megatron's ``dp_reshardable``
or ``fully_reshardable`` format, RNG states, ``weight_version`` and the layout it was saved
at; any layout resumes where the format allows), with the side-file and optimizer-format
checks that name the file or the field before any state changes. File-level checks and
metadata reads come from :mod:`moe_async.megatron.dist_ckpt_files`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np
import torch

from moe_async.compat import cpu_device_scope
from moe_async.megatron.sharding import padded_vocab_size
from moe_async.models import get_family
from moe_async.trainer.batching import dp_size
from moe_async.trainer.state import RngState, TrainerState
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict

Tensor = torch.Tensor


# the trainer's logger: these records keep the name they had before the trainer was split
_LOG = logging.getLogger("moe_async.trainer.megatron_trainer")


class Checkpointer:
    """Saves and loads the trainer state ``st`` (its models, optimizer and ``version``; a load
    sets ``st.version``) as torch_dist checkpoints; see the module docstring."""

    def __init__(self, st: TrainerState, base_digest: Callable[[], str] | None = None) -> None:
        self.st = st
        self.base_digest = base_digest  # LoRA: the frozen base's weights digest (collective)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: JsonDict | None = None) -> None:
        """Save model + optimizer as a Megatron ``torch_dist`` checkpoint (layout-independent;
        with the distributed optimizer, its state in 'dp_reshardable' format, resumable at another
        DP size only, or with ``trainer.dist_ckpt_optim_fully_reshardable`` in 'fully_reshardable'
        format, resumable at any layout), plus ``version``, this rank's RNG state and ``extra``.

        Files besides the torch_dist shards: ``moe_async_version.txt`` (``version``);
        ``moe_async_state.json`` (rank 0: ``version``, the saving ``layout`` and ``extra``, a
        JSON-able dict, e.g. the driver's data-side step and prompt position; with
        ``trainer.lora`` also ``lora``, the base the adapters belong to: the tensors are then
        the adapters and their optimizer state only, :mod:`moe_async.lora.checkpoint`);
        ``moe_async_rng/rank_<r>.pt`` (every rank: python ``random``, numpy, torch CPU and, when
        CUDA is available, CUDA generator states, and Megatron's RNG tracker states, as
        Megatron-LM's ``rng_state``). There is no separate scheduler state: the LR is a pure
        function of ``version`` (:func:`~moe_async.trainer.grpo_step.set_lr`), so restoring the step restores the schedule.
        Saving into a directory that holds a checkpoint overwrites it: its old checkpoint
        files are removed first (:meth:`_remove_old_checkpoint_files`; other files stay).
        The caller's script needs an ``if __name__ == "__main__"`` guard. Collective."""
        import json
        import random

        import numpy as np
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import random as mrandom

        lora = self._lora_record()  # before any file changes (collective: the base digest)
        os.makedirs(path, exist_ok=True)
        if torch.distributed.get_rank() == 0:
            self._remove_old_checkpoint_files(path)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # no rank writes before the old files are gone
        with cpu_device_scope():
            from moe_async.megatron.container import trainer_common_state

            from moe_async.megatron.te_spec_names import add_te_extra_state

            model_sd = self._model_sharded_state_dict()
            add_te_extra_state(model_sd)  # the TE modules' _extra_state: a TE-spec model loads it strictly
            sd = {
                **trainer_common_state(self.st),  # Megatron-LM's iteration / args / checkpoint_version (common.pt)
                **model_sd,
                "optimizer": self.st.optimizer.sharded_state_dict(self._model_sharded_state_dict(),
                                                               **self._optim_ckpt_kwargs()),
            }
            dist_checkpointing.save(sd, path)
        rank = torch.distributed.get_rank()
        rng: RngState = {
            "layout": self._ckpt_layout(),
            "random": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": mrandom.get_cuda_rng_tracker().get_states(),
        }
        os.makedirs(os.path.join(path, "moe_async_rng"), exist_ok=True)
        torch.save(rng, os.path.join(path, "moe_async_rng", f"rank_{rank}.pt"))
        if rank == 0:
            with open(os.path.join(path, "moe_async_version.txt"), "w") as f:
                f.write(str(self.st.version))
            with open(os.path.join(path, "moe_async_state.json"), "w") as f:
                json.dump({"version": self.st.version, "layout": self._ckpt_layout(), "extra": extra or {},
                           **({"lora": lora} if lora is not None else {})}, f)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # every rank's files are written when any rank returns

    def _lora_record(self) -> JsonDict | None:
        """The ``lora`` entry of ``moe_async_state.json`` (None without ``trainer.lora``). Collective."""
        if self.st.cfg.lora is None:
            return None
        from moe_async.lora.checkpoint import lora_record

        assert self.base_digest is not None, "a LoRA trainer's Checkpointer needs base_digest"
        return lora_record(self.st.cfg.lora, self.st.hf_path, self.base_digest())

    @staticmethod
    def _remove_old_checkpoint_files(path: str) -> None:
        """Before saving into ``path``: remove the files a previous checkpoint there left
        (``__<rank>_<i>.distcp``, ``.metadata``, ``metadata.json``, ``common.pt``, our
        ``moe_async_*`` files and ``moe_async_rng/``, and a converter-made checkpoint's
        ``hf_config.json`` and ``moe_async_convert.json``, which a load would otherwise check
        the new weights against, and a Megatron-LM tracker, which a load would otherwise follow
        to the old iteration dir), with a WARNING log line, as Megatron-LM
        overwrites. A save at fewer ranks would otherwise leave the old ranks' shards and RNG
        files beside the new ones (a later load at the old layout restored a stale rank's RNG
        state). Other files are left alone."""
        import re
        import shutil

        old = [n for n in os.listdir(path)
               if re.fullmatch(r"__\d+_\d+\.distcp|\.metadata|metadata\.json|common\.pt|"
                               r"moe_async_version\.txt|moe_async_state\.json|moe_async_rng|"
                               r"hf_config\.json|moe_async_convert\.json|latest_checkpointed_iteration\.txt", n)]
        if not old:
            return
        _LOG.warning("save_checkpoint: %s holds a checkpoint; overwriting it (%d old files "
                                            "removed)", path, len(old))
        for n in old:
            f = os.path.join(path, n)
            shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)

    def _model_sharded_state_dict(self, ckpt_keys: Mapping[str, object] | None = None) -> ShardedStateDict:
        """The model part of a torch_dist state dict, as Megatron-LM's ``generate_state_dict``:
        ``{"model": sd}`` for one chunk, ``{"model0": sd0, "model1": sd1, ...}`` for virtual
        pipeline chunks (in ``vp_stage`` order). The tensor keys inside are global (layer
        numbers from each chunk's offset), so checkpoints load at any PP/VPP layout, and the
        Transformer Engine spec's names on any machine (:mod:`moe_async.megatron.te_spec_names`);
        ``ckpt_keys`` (loading): the checkpoint's keys, whose spec's names are then used."""
        from moe_async.megatron.te_spec_names import match_checkpoint, to_te_names

        if len(self.st.models) == 1:
            sd = {"model": self.st.model.sharded_state_dict()}
        else:
            sd = {f"model{v}": m.sharded_state_dict() for v, m in enumerate(self.st.models)}
        if self.st.cfg.lora is not None:  # the adapters only (moe_async.lora.checkpoint); the base is the HF one
            from moe_async.lora.checkpoint import adapter_sharded_state_dict

            sd = {k: adapter_sharded_state_dict(v, m) for (k, v), m in zip(sd.items(), self.st.models)}
        to_te_names(sd) if ckpt_keys is None else match_checkpoint(sd, ckpt_keys)
        return sd

    # Megatron's distributed optimizer saves its state in one of two of Megatron-Core's formats
    # (DistributedOptimizer.sharded_state_dict): 'dp_reshardable' (Megatron-LM's default),
    # per-bucket shards each rank writes without communication, loadable at any DP size but only
    # at the saving TP/PP/EP/ETP/VPP/CP (the buckets follow the model chunks and their parameters;
    # _check_optimizer_format); or, with trainer.dist_ckpt_optim_fully_reshardable (Megatron-LM's
    # --dist-ckpt-optim-fully-reshardable), 'fully_reshardable': gathered over the DP group and
    # stored per parameter under the model's global keys, so torch_dist reshards it like the
    # weights (any layout). Loading reads the format the checkpoint records. With torch's Adam (no
    # Apex/TE, always on CPU) both need compat mend 13 (moe_async/compat/dist_opt_step.py: the
    # per-parameter 'step'). Megatron-Core's default, 'fully_sharded_model_space', raises
    # 'ShardedTensor.flattened_range is not supported' on save and is not offered.
    _DIST_OPT_FORMATS = ("dp_reshardable", "fully_reshardable")

    def _dist_opt_save_format(self) -> str:
        """The format this trainer saves distributed-optimizer state in (see above)."""
        return "fully_reshardable" if self.st.cfg.dist_ckpt_optim_fully_reshardable else "dp_reshardable"

    def _optim_ckpt_kwargs(self, fmt: str | None = None) -> dict[str, dict[str, str | bool]]:
        """Keyword arguments of ``optimizer.sharded_state_dict`` (the ``metadata`` Megatron-LM's
        checkpointing passes): the distributed optimizer's sharding type ``fmt`` (default: the
        one this trainer saves in); none without the distributed optimizer (format unchanged)."""
        if not self.st.cfg.use_distributed_optimizer:
            return {}
        return {"metadata": {"distrib_optim_sharding_type": fmt or self._dist_opt_save_format(),
                             "chained_optim_avoid_prefix": True}}

    @staticmethod
    def _saved_dist_opt_format(common: object, opt_keys: list[str]) -> str | None:
        """The distributed-optimizer format a checkpoint's optimizer state was saved in, None for
        the plain optimizer's. ``common``: the checkpoint's common (non-tensor) optimizer state,
        where Megatron records ``param_state_sharding_type`` (once per chained optimizer);
        ``opt_keys``: its optimizer tensor keys (``*optimizer.distributed.*`` are
        'dp_reshardable' buckets, the fallback when no type is recorded).

        Raises:
            UserInputError (a ValueError): chained optimizers saved in different formats."""
        from moe_async.errors import UserInputError

        found: set[str] = set()

        def walk(x: object) -> None:
            if isinstance(x, dict):
                if isinstance(x.get("param_state_sharding_type"), str):
                    found.add(x["param_state_sharding_type"])
                for v in x.values():
                    walk(v)

        walk(common)
        if len(found) > 1:
            raise UserInputError(f"its optimizer state mixes distributed-optimizer formats {sorted(found)}")
        if found:
            return found.pop()
        return "dp_reshardable" if any(".distributed." in k for k in opt_keys) else None

    def _init_dist_opt_state(self) -> None:
        """Allocate the Adam state of a distributed optimizer that has not stepped yet, before its
        sharded state dict is built for loading. Answers Megatron-Core 0.16.1's
        ``DistributedOptimizer.state_dict``, which without Apex/Transformer Engine reads
        'step' from the per-parameter state (``assert len(steps) == 1`` on an empty one).
        Uses Megatron's own ``_init_optimizer_states_with_dummy_values`` (a step on zero
        gradients, as for its fsdp_dtensor format); that step's weight decay would move the
        weights (fp32 main params are views of them), so they are put back; the checkpoint
        then overwrites the state, the main params and the step."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        opts = [o for o in getattr(self.st.optimizer, "chained_optimizers", [self.st.optimizer])
                if isinstance(o, DistributedOptimizer) and len(o.optimizer.state) == 0]
        if not opts:
            return
        keep = [(p, p.detach().clone()) for m in self.st.models for p in m.parameters()]
        for o in opts:
            o._init_optimizer_states_with_dummy_values()
        with torch.no_grad():
            for p, v in keep:
                p.copy_(v)

    # layout keys a checkpoint records; absent from checkpoints written before they were added
    # (virtual pipeline, context parallel, expert tensor parallel): those were saved at 1
    _LAYOUT_DEFAULTS = {"vpp": 1, "cp": 1, "etp": 1, "grouped": 0}
    # the layout a 'dp_reshardable' distributed-optimizer checkpoint (per-bucket state) needs
    _DIST_OPT_LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "vpp", "cp")

    def _check_optimizer_format(self, path: str, fmt: str | None, state: JsonDict | None) -> None:
        """A checkpoint's optimizer state must match this trainer's optimizer. ``fmt``: the
        format it was saved in (:meth:`_saved_dist_opt_format`; None = the plain optimizer's).
        The distributed optimizer's loads only into a distributed optimizer (whatever
        ``trainer.dist_ckpt_optim_fully_reshardable`` says): 'fully_reshardable' at any layout,
        'dp_reshardable' at the saving TP/PP/EP/ETP/VPP/CP (any DP); the plain optimizer's only
        into a plain one (its state is keyed by global parameter names, so it loads at any
        layout). ``state`` is ``moe_async_state.json`` (None when absent), whose ``layout`` is
        the only record of the saving layout: a 'dp_reshardable' checkpoint without it is
        refused, as Megatron's bucket-space state would otherwise be read into the wrong
        parameters at another layout.

        Raises:
            UserInputError (a ValueError) naming ``trainer.use_distributed_optimizer``, an
            unsupported format, the two layouts, or the missing ``moe_async_state.json``.
        """
        from moe_async.errors import UserInputError

        saved_do = fmt is not None
        do = bool(self.st.cfg.use_distributed_optimizer)
        if saved_do != do:
            raise UserInputError(
                f"checkpoint {path}: its optimizer state was saved "
                f"{'with' if saved_do else 'without'} Megatron's distributed optimizer and this trainer has "
                f"trainer.use_distributed_optimizer={str(do).lower()}; set it to {str(saved_do).lower()} to resume")
        if not do:
            return
        if fmt not in self._DIST_OPT_FORMATS:
            raise UserInputError(
                f"checkpoint {path}: its distributed-optimizer state is in Megatron's {fmt!r} format, which "
                f"this trainer does not read (it reads {' and '.join(map(repr, self._DIST_OPT_FORMATS))})")
        # the grouped and the sequential expert MLP share the weights' keys, not the distributed
        # optimizer's state (its buffers follow the parameters: read across, it lands on other ones)
        saved_grouped = int({**self._LAYOUT_DEFAULTS, **((state or {}).get("layout") or {})}["grouped"])
        if isinstance((state or {}).get("layout"), dict) and saved_grouped != self._ckpt_layout()["grouped"]:
            raise UserInputError(
                f"checkpoint {path}: its distributed-optimizer state was saved with the "
                f"{'grouped' if saved_grouped else 'sequential'} expert MLP and this trainer has "
                f"trainer.moe_grouped_gemm={str(not saved_grouped).lower()}; resume with "
                f"trainer.moe_grouped_gemm={str(bool(saved_grouped)).lower()} (the weights of either load into the "
                "other; the distributed optimizer's state does not)")
        if fmt == "fully_reshardable":
            return  # keyed per parameter like the weights: any layout
        saved = (state or {}).get("layout")
        if not isinstance(saved, dict):
            raise UserInputError(
                f"checkpoint {path}: its distributed-optimizer state ({fmt}) loads only at "
                f"the saving TP/PP/EP/ETP/VPP/CP, and {os.path.join(path, 'moe_async_state.json')} (which records that "
                f"layout) is {'missing' if state is None else 'without a layout'}; restore the file or resume "
                "from another checkpoint")
        saved = {**self._LAYOUT_DEFAULTS, **saved}
        now = self._ckpt_layout()
        keys = self._DIST_OPT_LAYOUT_KEYS
        diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
        if diff:
            lay_str = lambda lay: " ".join(f"{k.upper()}{lay.get(k)}" for k in keys)  # noqa: E731
            raise UserInputError(
                f"checkpoint {path}: distributed-optimizer state ({fmt}) loads at "
                f"another DP size but not at another TP/PP/EP/ETP/VPP/CP (saved vs now: {diff}; saved at "
                f"{lay_str(saved)}, this trainer at {lay_str(now)}); resume at the saving layout (checkpoints "
                "saved with trainer.dist_ckpt_optim_fully_reshardable=true resume at any layout)")

    def _ckpt_layout(self) -> dict[str, int]:
        """The world layout RNG states and distributed-optimizer state belong to: world size,
        TP, PP, EP, ETP, VPP (model chunks per PP rank, 1 without a virtual pipeline), CP, DP,
        and ``grouped`` (1: a MoE model's experts are the grouped expert MLP)."""
        grouped = int(bool(self.st.cfg.moe_grouped_gemm and self.st.family.arch_args(self.st.hf_config).num_experts))
        return {"world_size": torch.distributed.get_world_size(), "grouped": grouped,
                "tp": self.st.cfg.tensor_model_parallel_size, "pp": self.st.cfg.pipeline_model_parallel_size,
                "ep": self.st.cfg.expert_model_parallel_size,
                "etp": getattr(self.st.cfg, "expert_tensor_parallel_size", 1) or 1,
                "vpp": self.st.cfg.virtual_pipeline_model_parallel_size or 1,
                "cp": getattr(self.st.cfg, "context_parallel_size", 1) or 1, "dp": dp_size()}

    _RNG_KEYS = ("layout", "random", "numpy", "torch", "cuda", "tracker")

    def _read_ckpt_side_files(self, path: str) -> tuple[int | None, JsonDict | None, RngState | None]:
        """Read and check the files :meth:`save` writes besides the tensors, before
        anything of this trainer changes: ``(version, state, rng)`` from
        ``moe_async_version.txt`` (an int), ``moe_async_state.json`` (a JSON object whose
        ``layout`` and ``extra`` are objects) and this rank's ``moe_async_rng/rank_<r>.pt``
        (a dict with the RNG states); None for a file that is absent.

        Collective at world size > 1: every rank learns whether any rank failed, so that all
        raise together (one rank alone would leave the others waiting in the next collective).

        Raises:
            CheckpointReadError naming the file (and the rank for an RNG file).
        """
        import json

        import torch.distributed as dist

        from moe_async.errors import CheckpointReadError

        rank = dist.get_rank() if dist.is_initialized() else 0
        version = state = rng = None
        err = None
        ver_p = os.path.join(path, "moe_async_version.txt")
        state_p = os.path.join(path, "moe_async_state.json")
        rng_p = os.path.join(path, "moe_async_rng", f"rank_{rank}.pt")
        cur = ver_p
        try:
            if os.path.exists(ver_p):
                with open(ver_p) as f:
                    text = f.read().strip()
                if not text.isdigit():
                    raise ValueError(f"expected a non-negative integer (the weight_version), got {text[:40]!r}")
                version = int(text)
            cur = state_p
            if os.path.exists(state_p):
                with open(state_p) as f:
                    state = json.load(f)
                if not isinstance(state, dict):
                    raise ValueError(f"expected a JSON object, got {type(state).__name__}")
                for k in ("layout", "extra"):
                    if k in state and not isinstance(state[k], dict):
                        raise ValueError(f"{k!r} is a {type(state[k]).__name__}, not an object")
            cur = rng_p
            if os.path.exists(rng_p):
                rng = torch.load(rng_p, weights_only=False)  # written by save_checkpoint (numpy state)
                if not isinstance(rng, dict) or any(k not in rng for k in self._RNG_KEYS):
                    raise ValueError(f"not an RNG state file of this trainer (needs keys {list(self._RNG_KEYS)})")
        except Exception as e:  # noqa: BLE001 - truncated text/JSON/zip: OSError, ValueError, RuntimeError, EOFError, ...
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            err = (f"checkpoint {path}: cannot read {cur} (rank {rank}; {type(e).__name__}: "
                   f"{(lines[-1] if lines else '')[:200]}); the trainer is unchanged")
        if dist.is_initialized() and dist.get_world_size() > 1:
            errs: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            err = next((x for x in errs if x), None)
        if err:
            raise CheckpointReadError(err)
        return version, state, rng

    def load(self, path: str) -> JsonDict:
        """Load a torch_dist checkpoint into this trainer, at any parallel layout (torch_dist
        reshards on load). Returns the ``extra`` dict given to :meth:`save` (``{}``
        when the checkpoint has none). ``path``: the torch_dist directory, or a Megatron-LM
        container root (its ``latest_checkpointed_iteration.txt`` names the ``iter_*`` dir);
        tensor keys under either layer spec's names (Transformer Engine or local).

        Two kinds are accepted:

        * written by :meth:`save`: model, optimizer state and ``version`` (which
          also restores the LR schedule, a pure function of ``version``); this rank's RNG
          states are restored when the saving layout (world size, TP, PP, EP, ETP, VPP, CP, DP)
          equals this one, else an INFO log line says they are not (Megatron-LM's
          ``--no-load-rng``). Distributed-optimizer state is read in the format it was saved in
          (recorded in the checkpoint): 'fully_reshardable' at any layout, 'dp_reshardable' only
          at the saving TP/PP/EP/ETP/VPP/CP (any DP), read from ``moe_async_state.json``;
        * model only (``tools/convert_hf_to_megatron.py``, or any checkpoint without
          optimizer tensors): the model is loaded, the optimizer starts fresh (its
          state, if this trainer already stepped, is cleared; bf16 main params are re-read
          from the loaded model, as Megatron-LM's ``--no-load-optim`` / ``--finetune`` do),
          ``version`` is read from ``moe_async_version.txt`` when present, else 0; a log line
          (``logging``, WARNING) says so.

        Everything that can fail is read and checked before any weight or optimizer state of
        this trainer changes: the side files, then the model tensors and the optimizer state
        (read into copies: torch_dist would otherwise read into the live tensors, and the
        distributed optimizer's fp32 main params are views of the weights), then they are
        applied. A failed load leaves the trainer as it was (weights, optimizer state,
        version, RNG). Memory: the model and optimizer state are held twice while loading.

        The checkpoint's vocab rows (Megatron pads V) must equal this model's: ValueError
        naming ``trainer.make_vocab_size_divisible_by`` and TP otherwise. A
        ``hf_config.json`` next to the tensors (written by the converter) must describe
        the same architecture as this trainer's HF config: ValueError naming the first
        differing field. Collective at world size > 1.

        Raises:
            FileNotFoundError: ``path`` is not a directory.
            CheckpointReadError (a UserInputError and a RuntimeError): a file that cannot be
                read, named: ``.metadata``, ``metadata.json`` or ``common.pt`` truncated or
                corrupt, a ``.distcp`` shard missing or shorter than its items
                (:func:`moe_async.megatron.dist_ckpt_files.check_torch_dist_files`, before any tensor is read),
                shard bytes that do not deserialise (model or optimizer part),
                ``moe_async_version.txt``, ``moe_async_state.json``,
                ``moe_async_rng/rank_<r>.pt``, ``hf_config.json``.
            UserInputError (a ValueError): optimizer kind or ('dp_reshardable' distributed
                optimizer state) layout differs from the saving one, ``moe_async_state.json`` is
                missing for a 'dp_reshardable' checkpoint, or the distributed-optimizer format is
                neither 'dp_reshardable' nor 'fully_reshardable'.
            KeyError: naming the model tensors absent from the checkpoint, or the checkpoint
                tensors (other than optimizer state) this model does not use (checked on
                every rank, before any weight is changed).
        """
        import json

        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.validation import StrictHandling

        from moe_async.errors import CheckpointReadError

        log = _LOG
        from moe_async.megatron.container import resolve

        path = resolve(path)  # a Megatron-LM container root -> its iteration dir (flat dirs as they are)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint dir {path} " + ("is a file, not a checkpoint directory"
                                                                 if os.path.exists(path) else "does not exist"))
        cfg_p = os.path.join(path, "hf_config.json")
        if os.path.exists(cfg_p):
            try:
                with open(cfg_p) as f:
                    saved = json.load(f)
                a_saved = get_family(saved.get("model_type")).arch_args(saved)
            except (OSError, ValueError, AttributeError, TypeError) as e:
                raise CheckpointReadError(f"checkpoint {path}: cannot read {cfg_p} ({type(e).__name__}: "
                                          f"{str(e)[:200]}); the trainer is unchanged") from e
            a_now = self.st.family.arch_args(self.st.hf_config)
            if a_saved != a_now:
                diff = [k for k in dataclasses.fields(a_now) if getattr(a_saved, k.name) != getattr(a_now, k.name)]
                k = diff[0].name if diff else "model_type"
                raise ValueError(f"checkpoint {path}: its hf_config.json differs from this trainer's HF config "
                                 f"in field {k} ({getattr(a_saved, k, None)!r} vs {getattr(a_now, k, None)!r})")
        from moe_async.megatron.dist_ckpt_files import check_torch_dist_files, is_optimizer_key, saved_vocab_rows
        from moe_async.megatron.te_spec_names import is_te_extra_state


        # metadata, common.pt and every shard's length, each named, before any tensor is read
        try:
            metadata = check_torch_dist_files(path)
        except CheckpointReadError as e:
            raise CheckpointReadError(f"{e}; the trainer is unchanged") from None
        rows = saved_vocab_rows(path, metadata)
        want = padded_vocab_size(self.st.vocab_size, self.st.cfg.tensor_model_parallel_size,
                                 self.st.cfg.make_vocab_size_divisible_by)
        if rows is not None and rows != want:
            raise ValueError(
                f"checkpoint {path} has {rows} (padded) vocab rows, this trainer's model {want} "
                f"(V={self.st.vocab_size}, trainer.make_vocab_size_divisible_by="
                f"{self.st.cfg.make_vocab_size_divisible_by}, TP={self.st.cfg.tensor_model_parallel_size}); "
                "set make_vocab_size_divisible_by (or convert with --vocab-div) so that they agree")
        version, state, rng = self._read_ckpt_side_files(path)
        from moe_async.lora.checkpoint import check_lora_resume

        check_lora_resume(path, (state or {}).get("lora"), self.st.cfg.lora, self.st.hf_path,
                          self.base_digest or (lambda: ""))  # another base or adapter shape: refused, named

        # torch_dist reads into the tensors it is given: give it copies, so that a load failing
        # halfway (a truncated shard) leaves this trainer's weights and optimizer state untouched
        def _own_copy(x):
            if isinstance(getattr(x, "data", None), torch.Tensor):
                x.data = x.data.detach().clone()
            return x

        def _read(sd: ShardedStateDict, what: str, **kw):
            try:
                return dist_checkpointing.load(sd, path, **kw)
            except BaseException as e:  # torch's CheckpointException derives from BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                cause = lines[-1][:200] if lines else ""  # torch's text ends with the rank's error
                raise CheckpointReadError(f"checkpoint {path}: cannot read its {what} (.distcp shards), the "
                                          f"trainer's weights and optimizer state are unchanged "
                                          f"({type(e).__name__}: {cause})") from e

        with cpu_device_scope():
            ckpt_keys = metadata.state_dict_metadata  # the names (either layer spec's) the checkpoint uses
            model_sd = self._model_sharded_state_dict(ckpt_keys)
            dict_list_map_inplace(_own_copy, model_sd)
            # Megatron's naming: "unexpected" = asked for by this rank's model but absent from
            # the checkpoint (local); "missing" = in the checkpoint, asked for by no rank (global)
            loaded, in_ckpt_only, absent = _read(model_sd, "model tensors", strict=StrictHandling.RETURN_ALL)
            absent = {k for k in absent if not is_te_extra_state(k)}  # TE's FP8 metadata: see below
            if dist.is_initialized() and dist.get_world_size() > 1:
                everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
                dist.all_gather_object(everyone, sorted(absent))
                absent = set().union(*map(set, everyone))
            has_opt = any(is_optimizer_key(k) for k in in_ckpt_only)
            unused = sorted(k for k in in_ckpt_only if not is_optimizer_key(k) and not is_te_extra_state(k))
            if absent or unused:
                raise KeyError(
                    f"checkpoint {path}: "
                    + (f"model tensors missing from it {sorted(absent)[:20]} (of {len(absent)}); " if absent else "")
                    + (f"tensors this model does not use {unused[:20]} (of {len(unused)})" if unused else ""))
            opts = getattr(self.st.optimizer, "chained_optimizers", [self.st.optimizer])
            if has_opt:
                opt_keys = [k for k in in_ckpt_only if is_optimizer_key(k)]
                try:
                    fmt = self._saved_dist_opt_format(loaded.get("optimizer"), opt_keys)
                except ValueError as e:
                    raise type(e)(f"checkpoint {path}: {e}") from e
                self._check_optimizer_format(path, fmt, state)
                # the optimizer's sharded state dict needs allocated state: remember which
                # optimizers had none, to give them back none if the read fails
                fresh = [o for o in opts if len(o.optimizer.state) == 0]
                try:
                    self._init_dist_opt_state()
                    opt_sd = self.st.optimizer.sharded_state_dict(self._model_sharded_state_dict(ckpt_keys), is_loading=True,
                                                               **self._optim_ckpt_kwargs(fmt))
                    dict_list_map_inplace(_own_copy, opt_sd)
                    opt_loaded = _read({"optimizer": opt_sd}, "optimizer state")["optimizer"]
                except BaseException:
                    for o in fresh:
                        o.optimizer.state.clear()
                        o.reload_model_params()  # bf16: main params <- the (unchanged) weights
                    raise
                with torch.no_grad():  # fp32 + distributed optimizer: main params are views of the weights
                    self.st.optimizer.load_state_dict(opt_loaded)
            for key, m in zip(model_sd, self.st.models):
                got = loaded[key]
                # TE's FP8 metadata (a module's _extra_state) is absent from a checkpoint written
                # without TE (any CPU-written one): the module keeps its own (no weights in it);
                # LoRA: the frozen base's tensors too (the adapters are all there is)
                for k, v in m.state_dict().items():
                    if (k.endswith("._extra_state") or self.st.cfg.lora is not None) and k not in got:
                        got[k] = v
                m.load_state_dict(got)
            if not has_opt:
                for opt in opts:
                    opt.optimizer.state.clear()  # Adam moments and step: fresh
                self.st.optimizer.reload_model_params()  # bf16: main (fp32) params <- loaded model
        self.st.version = version if version is not None else 0
        if version is not None and (state is None or rng is None):  # a save_checkpoint dir missing files
            log.warning("checkpoint %s has moe_async_version.txt but no %s: loaded without them (no saved "
                        "step/data position%s)", path,
                        " and no ".join(n for n, x in (("moe_async_state.json", state),
                                                        (f"moe_async_rng/rank_{dist.get_rank() if dist.is_initialized() else 0}.pt", rng))
                                        if x is None),
                        "; RNG not restored" if rng is None else "")
        if not has_opt:
            log.warning("checkpoint %s holds no optimizer state: loaded the model only, the optimizer "
                        "starts fresh (weight_version=%d)", path, self.st.version)
        if rng is not None:
            saved_layout = {**self._LAYOUT_DEFAULTS, **(rng["layout"] or {})}
            if saved_layout == self._ckpt_layout():
                import random

                import numpy as np
                from megatron.core.tensor_parallel import random as mrandom

                random.setstate(rng["random"])
                np.random.set_state(rng["numpy"])
                torch.set_rng_state(rng["torch"])
                if rng["cuda"] is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state_all(rng["cuda"])
                mrandom.get_cuda_rng_tracker().set_states(rng["tracker"])
            else:
                log.info("checkpoint %s: RNG state not restored, the layout changed (saved %s, now %s)",
                         path, saved_layout, self._ckpt_layout())
        return dict((state or {}).get("extra") or {})
