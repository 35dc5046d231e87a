"""A rank's state as the bytes of a peer-memory copy, and back into its model and
optimizer (workers/checkpoint/peer_memory.py pushes and restores them).

The state is what a disk checkpoint saves for the rank: the model and optimizer as
`read_states` gives them (optimizer keys under whole-model names; DTensors as this
rank's local shards) and the rank state (RNG, data position). A copy is loaded as a
disk checkpoint is: `read_states` gives the shards to fill, the copy's tensors are
copied into them in place, and `write_states` loads the result, so a fresh
optimizer gets its state exactly as from DCP. Deserialized with the weights-only
loader (tensors, plain data, NumPy arrays), as rank files are.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from kuangchao.workers.checkpoint.files import load_plain, without_zip_crc
from kuangchao.workers.checkpoint.state_reader import read_states, write_states


def local_tensors(obj: Any) -> Any:
    """`obj` with every DTensor replaced by this rank's local shard (views, no copy)."""
    if isinstance(obj, torch.Tensor):
        return obj.to_local() if hasattr(obj, "to_local") else obj
    if isinstance(obj, dict):
        return {k: local_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_tensors(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(local_tensors(v) for v in obj)
    return obj


def serialize(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    with without_zip_crc():  # the whole copy is CRC-checked on its own
        torch.save(payload, buf)
    return buf.getvalue()


def deserialize(data: bytes | memoryview) -> dict[str, Any]:
    payload = load_plain(io.BytesIO(data))
    if not isinstance(payload, dict) or not {"model", "optim", "rank_state", "step"} <= set(payload):
        raise ValueError("not a peer-memory copy (model, optim, rank_state and step missing)")
    return payload


def _fit(template: Any, saved: Any, where: str, copy: bool) -> Any:
    """`saved` laid into `template` (the model's own state, as read_states gives it):
    tensors copied into the template's local shards, plain values taken from `saved`.
    With `copy=False` only checked. Raises ValueError where they differ."""
    if isinstance(template, torch.Tensor):
        local = template.to_local() if hasattr(template, "to_local") else template
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            got = (f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor)
                   else type(saved).__name__)
            raise ValueError(f"{where}: this rank holds {tuple(local.shape)} {local.dtype}, the copy {got}")
        if copy:
            with torch.no_grad():
                local.copy_(saved)
        return template
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            keys = set(saved) ^ set(template) if isinstance(saved, dict) else {"(not a mapping)"}
            raise ValueError(f"{where}: the keys differ ({sorted(map(str, keys))[:5]})")
        return {k: _fit(v, saved[k], f"{where}.{k}", copy) for k, v in template.items()}
    if isinstance(template, list | tuple) and not hasattr(template, "_fields"):
        if not isinstance(saved, list | tuple) or len(saved) != len(template):
            raise ValueError(f"{where}: {len(template)} items here, not so in the copy")
        items = [_fit(t, s, f"{where}[{i}]", copy)
                 for i, (t, s) in enumerate(zip(template, saved, strict=True))]
        return type(template)(items)
    return saved


def check_fits(payload: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises ValueError, saying where, unless the copy loads into these shards."""
    model_sd, optim_sd = read_states(model, optimizer)
    _fit(model_sd, payload["model"], "model", copy=False)
    _fit(optim_sd, payload["optim"], "optim", copy=False)


def apply(payload: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a copy's model and optimizer state, as a disk load does (read_states, fill, write_states)."""
    model_sd, optim_sd = read_states(model, optimizer)
    model_sd = _fit(model_sd, payload["model"], "model", copy=True)
    optim_sd = _fit(optim_sd, payload["optim"], "optim", copy=True)
    write_states(model, optimizer, model_sd, optim_sd)
