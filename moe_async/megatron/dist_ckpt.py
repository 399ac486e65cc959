"""Megatron ``torch_dist`` checkpoints: save/load strategies, file checks, metadata.

- :func:`save_strategy` / :func:`in_process_save_strategy`: Megatron-Core's torch_dist save
  strategy (threads or an in-process writer; items aligned to :data:`ITEM_ALIGN` bytes);
  :func:`whole_glu_tensors` (contiguous SwiGLU fc1 factories saved as one item).
- :func:`mmap_load_strategy` / :func:`load_megatron_into_model`: strict load through a
  memory-mapped reader (the mapped items adopted as parameters where they fit).
- The file checks and metadata reads: :mod:`moe_async.megatron.dist_ckpt_files`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import torch

from moe_async.megatron.dist_ckpt_files import is_optimizer_key, read_torch_dist_metadata
from moe_async.megatron.hf_io import prefault_read
from moe_async.megatron.parallel import cpu_tensors_only

Tensor = torch.Tensor
# Byte alignment of each item in the .distcp files this module writes (padding between items,
# which DCP's offsets skip); torch.save aligns a tensor's data to 64 bytes within its item,
# so a memory-mapped read finds every tensor aligned and can use it in place.
ITEM_ALIGN = 64


def save_strategy(threads: int = 0, fsync: bool = False):
    """The ``torch_dist`` save strategy used here. ``threads=0`` (default):
    :func:`in_process_save_strategy` (``fsync`` as given); ``threads>=1``: Megatron-Core's own
    ``TorchDistSaveShardedStrategy`` with ``threads`` forked writer processes per rank (it
    fsyncs every file whatever ``fsync`` says). At DP > 1 either is wrapped in
    ``FullyParallelSaveStrategyWrapper`` so that the replicated tensors' writes are spread
    over the data-parallel ranks instead of all falling to DP rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if threads < 0:
        raise ValueError(f"save threads must be >= 0, got {threads}")
    if threads == 0:
        st = in_process_save_strategy(fsync=fsync)
    else:
        st = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        st = FullyParallelSaveStrategyWrapper(st, ps.get_data_parallel_group(with_context_parallel=True))
    return st


def in_process_save_strategy(fsync: bool = False):
    """A ``torch_dist`` save strategy that writes in the calling process.

    It is Megatron-Core's ``TorchDistSaveShardedStrategy`` (same key translation,
    ``MCoreSavePlanner``, decentralised plan, ``.metadata``, ``__<rank>_0.distcp`` file names,
    items serialised with ``torch.save`` by torch DCP's ``_write_item``: the output is an
    ordinary torch_dist checkpoint that ``dist_checkpointing.load`` reads at any layout) with
    a different writer (a ``FileSystemWriterAsync`` subclass): Megatron's writer starts a
    ``multiprocessing`` Manager process (spawn: a fresh interpreter, ~1-5 s on the first save
    of a process), forks ``thread_count`` writer processes per save and fsyncs every file;
    this one writes each rank's items into ONE file from the calling process, fsyncs the
    data file and ``.metadata`` only when ``fsync`` is set, and skips the CRC32 that
    ``torch.save`` computes per record (``torch.serialization.set_crc32_options(False)``
    while writing; ``torch.load``, which DCP uses to read items, never checks it). Write
    errors are returned to Megatron's finalisation as DCP's wrapped exceptions, so every rank
    raises ``CheckpointException``."""
    return _in_process_classes()[1](fsync=fsync)


@functools.cache
def _in_process_classes() -> tuple:
    """(writer class, strategy class), defined once Megatron-Core is imported."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.api import _wrap_exception
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    write_kw: dict[str, Any] = {}
    write_item: Callable[..., Any] = _write_item  # its arguments differ between torch versions
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        write_kw["serialization_format"] = SerializationFormat.TORCH_SAVE  # what DCP's reader expects

    class InProcessWriter(FileSystemWriterAsync):
        """``FileSystemWriterAsync`` whose save function writes in the calling process."""

        def __init__(self, path, fsync: bool):
            super().__init__(path, sync_files=fsync, thread_count=1)
            self.fsync = fsync
            self.results: Any = None

        def prepare_write_data(self, plan, planner) -> None:
            byte_items, tensor_items = [], []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    byte_items.append((item, data))
                    continue
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")
                elif t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    t = t.clone()  # torch.save would write the view's whole storage
                tensor_items.append((item, t))
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            self.write_buckets = ([(os.path.join(self.checkpoint_dir, name), name, (byte_items, tensor_items))]
                                  if byte_items or tensor_items else [])
            self.results_queue = None

        def get_save_function_and_args(self):
            if not self.write_buckets:
                self.results = []
                return None, None, []
            return self.write_in_process, None, []

        @cpu_tensors_only
        def write_in_process(self) -> None:
            transforms = [self.transforms] if hasattr(self, "transforms") else []
            crc = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            results = []
            try:
                for path, key, (byte_items, tensor_items) in self.write_buckets:
                    with open(path, "wb") as f:
                        for item, data in byte_items + tensor_items:
                            pad = -f.tell() % ITEM_ALIGN
                            if pad:  # items start aligned: a mapped read can use the data in place
                                f.write(b"\0" * pad)
                            results.append(write_item(*transforms, f, data, item, key, **write_kw))
                        if self.fsync:
                            f.flush()
                            os.fsync(f.fileno())
                self.results = results
            except Exception as e:  # noqa: BLE001 - handed to Megatron's finalisation (raised on every rank)
                self.results = _wrap_exception(e)
            finally:
                torch.serialization.set_crc32_options(crc)

        def retrieve_write_results(self):
            if self.results is None:
                return _wrap_exception(RuntimeError("torch_dist in-process writer: nothing was written"))
            return self.results

    class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
        """``TorchDistSaveShardedStrategy`` with :class:`InProcessWriter` (no cached plans)."""

        def __init__(self, fsync: bool = False):
            super().__init__("torch_dist", 1, thread_count=1)
            self.fsync = fsync

        def async_save(self, sharded_state_dict, checkpoint_dir):
            # Megatron-Core 0.16.1 TorchDistSaveShardedStrategy.async_save, with another writer
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = InProcessWriter(checkpoint_dir, self.fsync)
            ret = save_state_dict_async_plan(
                pyt_state_dict, writer, None, 0,
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False),
            )
            return self._get_save_and_finalize_callbacks(writer, ret[0])

    return InProcessWriter, InProcessSaveStrategy


@cpu_tensors_only
def whole_glu_tensors(sharded_state_dict: dict) -> int:
    """Replace, in place, each Megatron SwiGLU ``linear_fc1`` ``ShardedTensorFactory`` whose two
    halves (gate ``w``, up ``v``) are, in this order, ONE contiguous range of the global
    tensor (experts at ETP 1 at any TP; dense fc1 at TP 1) by one ``ShardedTensor`` of the
    whole local tensor (same key, global shape and offsets). Megatron's factory splits such a
    tensor into two views on save (which its writer clones: ``torch.save`` of a view writes
    the whole storage) and loads two halves that ``torch.cat`` merges into a new tensor; the
    whole tensor saves without a copy, loads in place, and is stored as one item covering the
    same elements, which DCP reads back at any layout (including through the factory).
    Other factories are left alone. Returns how many were replaced."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    n = 0

    def visit(d):
        nonlocal n
        items = d.items() if isinstance(d, dict) else enumerate(d)
        for k, v in list(items):
            if isinstance(v, (dict, list)):
                visit(v)
            elif isinstance(v, ShardedTensorFactory) and v.flattened_range is None and v.data is not None:
                w_v = v.build()
                if not (isinstance(w_v, list) and len(w_v) == 2 and all(isinstance(x, ShardedTensor) for x in w_v)):
                    continue
                w, u = w_v
                ax = w.prepend_axis_num
                whole = (w.key == u.key == v.key and u.prepend_axis_num == ax and w.flattened_range is None
                         and u.flattened_range is None and w.global_offset[ax] == 0
                         and u.global_offset[ax] == w.local_shape[0]
                         and w.global_shape[ax] == w.local_shape[0] + u.local_shape[0] == v.data.shape[0]
                         and w.global_shape == u.global_shape
                         and w.global_offset[:ax] == u.global_offset[:ax]
                         and w.global_offset[ax + 1:] == u.global_offset[ax + 1:]
                         and w.data.data_ptr() == v.data.data_ptr())
                if not whole:
                    continue
                frag = list(w.axis_fragmentations)
                frag[ax] = 1
                d[k] = ShardedTensor(w.key, v.data, v.data.dtype, tuple(v.data.shape), w.global_shape,
                                     w.global_offset, tuple(frag), w.replica_id, ax,
                                     allow_shape_mismatch=w.allow_shape_mismatch)
                n += 1

    visit(sharded_state_dict)
    return n



def mmap_load_strategy(adopt: list[Tensor] | None = None, metadata=None):
    """A ``torch_dist`` load strategy that reads tensor items through a memory map.

    Megatron-Core's ``TorchDistLoadShardedStrategy`` (same key translation, ``MCoreLoadPlanner``,
    ``torch.distributed.checkpoint.load_state_dict``: any saved layout, strict handling as
    usual) with a ``CachedMetadataFileSystemReader`` subclass whose ``read_data`` maps each
    ``.distcp`` file once (``torch.UntypedStorage.from_file``, private mapping) and
    deserialises each tensor item with the storage pointing into the map, as ``torch.load(...,
    mmap=True)`` does for a whole file (``torch.serialization._load`` with
    ``overall_storage``, weights-only unpickler): the one copy is then from the page cache
    into the target tensor, where DCP's ``FileSystemReader`` reads each item into a new
    buffer (``torch.load`` of the file slice) and then copies that into the target. Items
    with DCP storage transforms, byte items, and a torch without this private API go the
    stock way.

    ``adopt``: whole tensors (a model's parameters) that need not be written at all: a
    request whose target is one of them, whole, read from ONE item of the same dtype and
    shape (contiguous, aligned) leaves the target untouched and records the mapped item in
    the strategy's ``adopted`` (``{target data_ptr: mapped tensor}``, filled by ``load``);
    the caller must then re-point each such tensor (``p.data = adopted[p.data_ptr()]``), or
    it keeps its old, unread contents. The mapping is private (copy-on-write): writes to an
    adopted tensor never reach the file, and the file may be removed while it is in use.

    ``metadata``: the checkpoint's DCP ``Metadata`` already read (:func:`~moe_async.megatron.dist_ckpt_files.read_torch_dist_metadata`),
    used instead of reading ``.metadata`` again. A ``.distcp`` file shorter than its items'
    extents, or an item that does not deserialise, is a ValueError naming the file."""
    return _mmap_classes()[1](adopt=adopt, metadata=metadata)


@functools.cache
def _mmap_classes() -> tuple:
    """(reader class, load strategy class, common-state load strategy class), defined once
    Megatron-Core is imported."""
    import inspect
    from typing import cast

    import torch.serialization as ts
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        TorchDistLoadShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from torch.distributed import checkpoint
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    have_mmap_load = (hasattr(ts, "_load") and "overall_storage" in inspect.signature(ts._load).parameters
                      and hasattr(torch._C, "PyTorchFileReader") and hasattr(ts, "_weights_only_unpickler"))

    class MmapReader(CachedMetadataFileSystemReader):
        """``FileSystemReader`` reading tensor items from a memory map of their file.

        ``adoptable``: ``{data_ptr: tensor}`` of whole tensors (parameters) that may take the
        mapped item itself instead of a copy of it; such targets are left unwritten and listed
        in ``adopted`` (``{data_ptr: mapped tensor}``) for the caller to re-point."""

        def __init__(self, *args, adoptable: dict[int, Tensor] | None = None, metadata=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.adoptable = adoptable or {}
            self.adopted: dict[int, Tensor] = {}
            self._cached_metadata = metadata

        def _adopt(self, req, target: Tensor, t: Tensor) -> bool:
            # the target must be the whole adoptable tensor (possibly viewed with Megatron's
            # prepended layer / expert axes), read from one contiguous, aligned item region
            p = self.adoptable.get(target.data_ptr())
            if (p is None or target.data_ptr() in self.adopted or p.numel() != target.numel()
                    or not p.is_contiguous() or not target.is_contiguous() or not t.is_contiguous()
                    or p.dtype != target.dtype or t.dtype != target.dtype or t.shape != target.shape
                    or t.data_ptr() % ITEM_ALIGN):
                return False
            self.adopted[target.data_ptr()] = t.view(p.shape)
            return True

        @cpu_tensors_only
        def read_data(self, plan, planner):
            if not have_mmap_load:
                return super().read_data(plan, planner)
            per_file: dict[str, list] = {}
            stock = []
            for req in plan.items:
                md = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                    stock.append(req)
                else:
                    per_file.setdefault(md.relative_path, []).append(req)
            for rel, reqs in per_file.items():
                path = str(self.fs.concat_path(self.path, rel))
                size = os.path.getsize(path)
                end = max(self.storage_data[r.storage_index].offset + self.storage_data[r.storage_index].length
                          for r in reqs)
                if size < end:
                    raise ValueError(f"{path} (torch_dist data) is truncated: {size} bytes, its items in "
                                     f".metadata end at byte {end}")
                mapped = torch.UntypedStorage.from_file(path, False, size)
                with open(path, "rb") as stream:
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        md = self.storage_data[req.storage_index]
                        try:
                            zf = torch._C.PyTorchFileReader(self._slice_file(stream, md))
                            t = ts._load(zf, "cpu", ts._weights_only_unpickler,
                                         overall_storage=mapped[md.offset: md.offset + md.length])
                        except Exception as e:  # noqa: BLE001 - zip / unpickling errors of a corrupt item
                            raise ValueError(f"{path} (torch_dist data): the item at byte {md.offset} "
                                             f"({md.length} bytes) cannot be read, corrupt file: "
                                             f"{type(e).__name__}: {e}") from None
                        prefault_read(t)  # the item's pages, read by the copy or, adopted, by the HF write
                        t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != t.size():
                            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {t.size()}")
                        if not self._adopt(req, target, t):
                            target.copy_(t)
                        planner.commit_tensor(req, target)
                del mapped
            if stock:
                return super().read_data(dataclasses.replace(plan, items=stock), planner)
            fut: torch.futures.Future[None] = torch.futures.Future()
            fut.set_result(None)
            return fut

    class MmapLoadStrategy(TorchDistLoadShardedStrategy):
        """``TorchDistLoadShardedStrategy`` reading through :class:`MmapReader`."""

        def __init__(self, adopt: list[Tensor] | None = None, metadata=None):
            super().__init__()
            self.adoptable = {t.data_ptr(): t for t in (adopt or ()) if t.numel()}
            self.adopted: dict[int, Tensor] = {}
            self.metadata = metadata

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            return super().load_tensors_metadata(checkpoint_dir, metadata or self.metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            if self.metadata is None:
                return super().load_sharded_metadata(checkpoint_dir)
            # Megatron-Core 0.16.1 TorchDistLoadShardedStrategy.load_sharded_metadata, on the
            # metadata already read
            out = {}
            for key, smd in self.metadata.state_dict_metadata.items():
                if isinstance(smd, BytesStorageMetadata):
                    obj = ShardedObject.empty_from_unique_key(key)
                    out[obj.unique_key] = obj
            out.update(self.load_tensors_metadata(checkpoint_dir, self.metadata))
            return out

        def load(self, sharded_state_dict, checkpoint_dir):
            # Megatron-Core 0.16.1 TorchDistLoadShardedStrategy.load, with another reader
            shape_checked = [t for t in nested_values(sharded_state_dict)
                             if isinstance(t, McoreShardedTensor) and not t.allow_shape_mismatch]
            shape_free = {t.key: t for t in nested_values(sharded_state_dict)
                          if isinstance(t, McoreShardedTensor) and t.allow_shape_mismatch}
            orig = sharded_state_dict
            sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
            reader = MmapReader(checkpoint_dir, adoptable=self.adoptable, metadata=self.metadata)
            try:
                checkpoint.load_state_dict(pyt_state_dict, reader, planner=MCoreLoadPlanner(
                    shapes_validation_sharded_tensors=shape_checked, allow_shape_mismatch_sharded_tensors=shape_free))
            except CheckpointException as e:  # DCP wraps each rank's error: raise a file-naming one as is
                for failure in e.failures.values():
                    exc = failure[0] if isinstance(failure, tuple) else failure
                    if isinstance(exc, ValueError):
                        raise exc from None
                raise
            self.adopted = reader.adopted
            self.cached_global_metadata = reader.read_metadata()
            out = {k: _unwrap_pyt_sharded_tensor(v) for k, v in cast(dict, pyt_state_dict).items()}
            out = _replace_sharded_keys_with_state_dict_keys(out, flat_mapping, rename_mapping)
            _restore_dict_types(out, orig)
            return out

    class CommonLoadStrategy(TorchCommonLoadStrategy):
        """Megatron's ``common.pt`` loader with a truncated or corrupt file named in the error."""

        def load_common(self, checkpoint_dir):
            try:
                return super().load_common(checkpoint_dir)
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 - torch.load raises many kinds on a cut file
                p = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
                raise ValueError(f"{p} (torch_dist common state) cannot be read, truncated or corrupt: "
                                 f"{type(e).__name__}: {e}") from None

    return MmapReader, MmapLoadStrategy, CommonLoadStrategy


# ------------------------------------------------------------------------- Megatron -> HF
def load_megatron_into_model(model, megatron_dir: str, metadata=None) -> None:
    """``dist_checkpointing.load`` of the ``model`` part of a torch_dist checkpoint into
    ``model`` (any saved layout), read by :func:`mmap_load_strategy` straight into the
    parameters, or, where one aligned item holds a whole parameter, with the parameter
    re-pointed at the item in the file's private map (no copy at all): SwiGLU fc1 tensors whole (:func:`whole_glu_tensors`), the vocab-padded
    tensors not zero-filled first when the checkpoint has the model's padded shape, and the
    final ``load_state_dict`` copying only tensors that were not loaded in place. KeyError
    naming checkpoint tensors the model does not use or model tensors absent from the
    checkpoint. ``metadata``: the checkpoint's
    :func:`~moe_async.megatron.dist_ckpt_files.read_torch_dist_metadata` (read when
    not given; used for every metadata lookup of the load). A truncated or corrupt
    ``metadata.json``, ``.metadata``, ``common.pt`` or ``.distcp`` file is a ValueError naming
    the file."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from moe_async.megatron.te_spec_names import is_te_extra_state, match_checkpoint

    if metadata is None:
        metadata = read_torch_dist_metadata(megatron_dir)
    sd = model.sharded_state_dict()
    match_checkpoint(sd, metadata.state_dict_metadata)  # either spec's key names
    whole_glu_tensors(sd)
    md = metadata.state_dict_metadata
    for t in nested_values(sd):
        # Megatron zero-fills a vocab-padded tensor before the load (rows the checkpoint may
        # lack); at the saved padded shape every element is read
        if (isinstance(t, ShardedTensor) and t.allow_shape_mismatch and t.key in md
                and tuple(getattr(md[t.key], "size", ())) == tuple(t.global_shape)):
            t.allow_shape_mismatch = False
    # Megatron's naming: "unexpected" = requested by the model but absent from the checkpoint,
    # "missing" = in the checkpoint but not requested.
    # the plain tensors' targets may take the mapped items themselves (no copy): re-pointed below
    strategy = mmap_load_strategy(adopt=[t.data for t in nested_values(sd) if isinstance(t, ShardedTensor)
                                         and t.flattened_range is None], metadata=metadata)
    loaded, in_ckpt_only, absent = dist_checkpointing.load(
        {"model": sd}, megatron_dir, sharded_strategy=strategy, common_strategy=_mmap_classes()[2](),
        strict=StrictHandling.RETURN_ALL,
    )
    repointed = _adopt_mapped(model, strategy)
    missing = sorted(absent)
    # optimizer state saved by MegatronTrainer.save_checkpoint is not a model tensor
    unexpected = sorted(k for k in in_ckpt_only if not is_optimizer_key(k) and not is_te_extra_state(k))
    if missing or unexpected:
        raise KeyError(
            "Megatron -> HF conversion: "
            + (f"model tensors missing from the checkpoint {missing[:20]} (of {len(missing)}); " if missing else "")
            + (f"unused checkpoint tensors {unexpected[:20]} (of {len(unexpected)})" if unexpected else "")
        )
    state = model.state_dict(keep_vars=True)
    got = loaded["model"]
    # a module's extra state that its sharded_state_dict leaves out (Megatron's output layer,
    # ColumnParallelLinear without TE: None) is nothing to load
    extra = {k for k in set(state) - set(got) if k.endswith("._extra_state") and state[k] is None}
    if set(got) != set(state) - extra:  # let load_state_dict name the difference
        model.load_state_dict({k: state[k] if isinstance(v, Tensor) and v.data_ptr() in repointed and k in state else v
                               for k, v in got.items()})
        return

    def in_place(k: str) -> bool:
        v, p = got[k], state[k]
        return (isinstance(v, Tensor) and isinstance(p, Tensor)
                and repointed.get(v.data_ptr(), v.data_ptr()) == p.data_ptr()
                and v.dtype == p.dtype and v.shape == p.shape and v.stride() == p.stride())

    rest = {k: v for k, v in got.items() if not in_place(k)}
    res = model.load_state_dict(rest, strict=False)
    if res.unexpected_keys or set(res.missing_keys) - (set(got) - set(rest)) - extra:  # pragma: no cover
        raise KeyError(f"Megatron -> HF conversion: load_state_dict {res}")


def _adopt_mapped(model, strategy) -> dict[int, int]:
    """After a load by ``mmap_load_strategy(adopt=...)``: each parameter / buffer of ``model``
    whose (unwritten) storage a mapped item was adopted for takes that item as its data
    (``p.data = item``); an adopted target that is no parameter of ``model`` gets the item
    copied into it instead. Returns ``{old data_ptr: new data_ptr}`` of the re-pointed tensors."""
    adopted = dict(strategy.adopted)
    moved: dict[int, int] = {}
    for _, p in list(model.named_parameters()) + list(model.named_buffers()):
        t = adopted.pop(p.data_ptr(), None) if p.numel() else None
        if t is None:
            continue
        if p.shape != t.shape or p.dtype != t.dtype or p.stride() != t.stride():  # pragma: no cover - checked on read
            strategy.adoptable[p.data_ptr()].copy_(t)
            continue
        moved[p.data_ptr()] = t.data_ptr()
        p.data = t
    for ptr, t in adopted.items():  # targets that are views of no parameter
        strategy.adoptable[ptr].copy_(t)
    strategy.adopted = {}
    return moved
