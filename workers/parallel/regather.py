"""Keep an all-gathered input's saved activations as this rank's shard; gather again in backward.

Under sequence parallelism a column-parallel projection needs the whole sequence,
all-gathered from the shards, and autograd saves that whole input for the weight's
gradient: tp times the shard, on every rank, in every block. Megatron (Korthikanti
et al. 2022, section 4.2.2) keeps only the shard and all-gathers it once more in
backward; its activation accounting (34/t bytes per token and channel, instead of
10 + 24/t) counts on it. Here that is a pair of saved-tensor hooks around the
module that consumes the gathered input: whatever autograd saves from the gathered
buffer (the buffer or a view of it, as a DTensor or a plain tensor) is packed as
the shard plus its view's geometry, and the first unpack in backward gathers the
buffer again, which every later unpack of the same forward reuses.

Hooks already in force (the activation count of bench/memory.py, say) still see
every saved tensor: the pair chains to them, handing them the shard in place of
the gathered buffer. A recomputed block saves nothing to keep (its caller leaves
the hooks out), and a compiled one keeps what it saves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

_PLAIN, _FROM_SHARD = 0, 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where `t`'s storage starts; None for a tensor without one of its own (a wrapper
    subclass such as an all-gather's result not waited for yet), which is never the buffer."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _whole_buffer(t: torch.Tensor) -> bool:
    """Whether `t` owns its storage exactly (contiguous, from offset 0): then a fresh
    gather of the same shape rebuilds any view of it with the same geometry."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class ShardKeeper:
    """One forward's gathered input: `shard` is this rank's piece (sequence dim `dim`)."""

    def __init__(self, gathered: torch.Tensor, shard: torch.Tensor, mesh: DeviceMesh,
                 dim: int) -> None:
        self.buffer_ptr = _local(gathered).untyped_storage().data_ptr()
        self.shape = _local(gathered).shape
        self.shard, self.mesh, self.dim = shard.detach(), mesh, dim
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._whole: torch.Tensor | None = None

    def pack(self, t: torch.Tensor) -> Any:
        outer_pack = self.outer[0] if self.outer else (lambda x: x)
        local = _local(t)
        if _storage_ptr(local) != self.buffer_ptr:
            return _PLAIN, outer_pack(t)
        geometry = (local.size(), local.stride(), local.storage_offset())
        spec = (t.device_mesh, t.placements, t.size(), t.stride()) if isinstance(t, DTensor) else None
        return _FROM_SHARD, outer_pack(self.shard), geometry, spec

    def unpack(self, packed: Any) -> torch.Tensor:
        outer_unpack = self.outer[1] if self.outer else (lambda x: x)
        if packed[0] == _PLAIN:
            return outer_unpack(packed[1])
        _, inner, (size, stride, offset), spec = packed
        view = self.whole(outer_unpack(inner)).as_strided(size, stride, offset)
        if spec is None:
            return view
        mesh, placements, shape, global_stride = spec
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape,
                                  stride=global_stride)

    def whole(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered buffer, gathered again on first use (backward runs without grad)."""
        if self._whole is None:
            with torch.no_grad():
                pieces = DTensor.from_local(shard, self.mesh, (Shard(self.dim),), run_check=False)
                whole = pieces.redistribute(self.mesh, (Replicate(),)).to_local().contiguous()
            if whole.shape != self.shape:
                raise AssertionError(f"re-gathered {tuple(whole.shape)}, saved {tuple(self.shape)}")
            self._whole = whole
        return self._whole


@contextmanager
def kept_as_shard(gathered: torch.Tensor, shard: torch.Tensor, mesh: DeviceMesh, dim: int):
    """Within, what autograd saves of `gathered` is kept as `shard` (see the module doc);
    a buffer that is not exactly its own storage is saved as it is."""
    # Meta tensors (a pipeline stage's shape inference) hold no data to keep.
    buffer = _local(gathered)
    if buffer.is_meta or not _whole_buffer(buffer) or torch.compiler.is_compiling():
        yield
        return
    keeper = ShardKeeper(gathered, shard, mesh, dim)
    with saved_tensors_hooks(keeper.pack, keeper.unpack):
        yield


Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def gathering(forward: Callable[..., Any], gather: Gather, mesh: DeviceMesh, dim: int,
              keep_shards: bool) -> Callable[..., Any]:
    """`forward` with its first argument, a shard, replaced by `gather(shard)` =
    (gathered, shard's local tensor); under grad and `keep_shards`, within `kept_as_shard`."""
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gathered, shard = gather(x)
        if not (keep_shards and torch.is_grad_enabled()):
            return forward(gathered, *args, **kwargs)
        with kept_as_shard(gathered, shard, mesh, dim):
            return forward(gathered, *args, **kwargs)
    return run
