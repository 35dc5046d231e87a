"""Reading the state for an asynchronous save, fast.

torch's `get_state_dict` spends most of its ~3 ms (for a few hundred tensors)
mapping optimizer parameter ids to names. `StateDictReader` learns that map
from one full call and reuses it while the model and optimizer are provably
the same objects, checking every save and falling back to the full call on
any doubt. Split from async_save.py, which stages and hands back the
pending save.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kuangchao.workers.checkpoint.async_save import alias_key


class StateDictReader:
    """`get_state_dict(model, optimizer)` for repeated saves of the same model and optimizer.

    For a model and optimizer that torch neither shards nor wraps (no FSDP, no
    DDP or compile prefix, no DTensor, no patched `state_dict`), `get_state_dict`
    returns `model.state_dict()` and `optimizer.state_dict()` with the
    optimizer's parameter ids replaced by the parameters' FQNs; most of its
    ~3 ms (a GPT with AdamW, 273 tensors) goes into working out that map and
    checking its options, again on every call. This reader calls both
    `state_dict()`s fresh every time, so every tensor, plain value (lr, betas)
    and state entry is the current one and hooks run as they would, and keeps
    only the id -> FQN map (~0.2 ms a call instead of ~3). It learns the map
    from a full `get_state_dict`, and uses it only if reading that way
    reproduced that result exactly.

    The map is used while the model's named parameters and the optimizer's
    parameters are the same objects under the same names, the model's state
    keys are the same and the optimizer has state. Anything else (a parameter
    replaced, a module added, another model or optimizer, an optimizer with no
    state yet, which `get_state_dict` initializes) takes `get_state_dict`
    again, which relearns the map. A model and optimizer whose full result the
    fast read did not reproduce (a DDP-wrapped model, DTensors) always take it,
    without trying again. Not thread-safe: one caller at a time.
    """

    def __init__(self) -> None:
        self._model: weakref.ref[torch.nn.Module] | None = None
        self._optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._fast = False  # the map below holds for these two
        self._never = False  # these two never fit: get_state_dict without relearning
        # Weak, so that a model the caller dropped is not kept alive here.
        self._named: list[tuple[str, weakref.ref[torch.Tensor]]] = []
        self._opt_params: list[tuple[None, weakref.ref[torch.Tensor]]] = []
        self._keys: list[str] = []
        self._fqn_of: dict[int, str] = {}

    def __call__(self, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """What `read_states(model, optimizer)` returns now."""
        whole, optimizer = optimizer, saved_optimizer(optimizer)
        if self._fast and self._fits(model, optimizer):
            state = self._read(model, optimizer)
            if state is not None:
                return state[0], _saved_groups(model, whole, to_saved_names(model, state[1]))
        full = get_state_dict(model, optimizer)
        self._learn(model, optimizer, full)
        return full[0], _saved_groups(model, whole, to_saved_names(model, full[1]))

    def _same_pair(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        return (self._model is not None and self._optimizer is not None
                and self._model() is model and self._optimizer() is optimizer)

    def _fits(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the learned map still holds for these two (the state keys aside)."""
        if not self._same_pair(model, optimizer) or not _readable(model, optimizer):
            return False
        return (_same_objects(model.named_parameters(), self._named)
                and _same_objects(((None, p) for g in optimizer.param_groups for p in g["params"]),
                                  self._opt_params))

    def _read(self, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Both state dicts, the optimizer's keyed by FQN; None where the map does not fit."""
        with torch.no_grad():  # as get_state_dict calls them
            model_sd = model.state_dict()
            osd = optimizer.state_dict()
        if list(model_sd) != self._keys:
            return None
        fqn_of = self._fqn_of
        try:
            state = {fqn_of[pid]: v for pid, v in osd["state"].items()}
            groups = osd["param_groups"]
            for g in groups:
                g["params"] = [fqn_of[pid] for pid in g["params"]]
        except (KeyError, TypeError):  # an id the map lacks: get_state_dict decides
            return None
        return model_sd, {"state": state, "param_groups": groups}

    def _learn(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               full: tuple[dict[str, Any], dict[str, Any]]) -> None:
        """Learn the map from `full`, `get_state_dict`'s result for these two just now."""
        if self._never and self._same_pair(model, optimizer):
            return
        self.__init__()  # type: ignore[misc]
        self._model, self._optimizer = weakref.ref(model), weakref.ref(optimizer)
        if not _readable(model, optimizer):  # not yet: the next call tries again
            return
        self._never = True  # unless the fast read proves itself below
        if not _all_plain(full):
            return
        with torch.no_grad():
            raw = optimizer.state_dict()
        fqn_of: dict[int, str] = {}
        try:
            groups, named_groups = raw["param_groups"], full[1]["param_groups"]
            if len(groups) != len(named_groups):
                return
            for g, named in zip(groups, named_groups, strict=True):
                if len(g["params"]) != len(named["params"]):
                    return
                for pid, fqn in zip(g["params"], named["params"], strict=True):
                    if fqn_of.setdefault(pid, fqn) != fqn:
                        return
        except (KeyError, TypeError):
            return
        self._fqn_of, self._keys = fqn_of, list(full[0])
        self._named = [(n, weakref.ref(p)) for n, p in model.named_parameters()]
        self._opt_params = [(None, weakref.ref(p)) for g in optimizer.param_groups for p in g["params"]]
        fast = self._read(model, optimizer)
        self._fast = fast is not None and _same_state(fast, full)
        self._never = not self._fast


def _readable(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `get_state_dict` would call these two's own `state_dict()`s and nothing else.

    Not when one was patched on the instance (torch's `_patch_*_state_dict`), nor
    for an optimizer without state, which `get_state_dict` first initializes.
    """
    return "state_dict" not in vars(model) and "state_dict" not in vars(optimizer) and bool(optimizer.state)


def _same_objects(pairs: Any, refs: list[tuple[Any, weakref.ref[torch.Tensor]]]) -> bool:
    """Whether `pairs` ((name, tensor), ...) are `refs`' names and very objects, in order."""
    n = 0
    for name, obj in pairs:
        if n >= len(refs) or refs[n][0] != name or refs[n][1]() is not obj:
            return False
        n += 1
    return n == len(refs)


def _all_plain(obj: Any) -> bool:
    """Whether every tensor in a nested state is a plain strided one (not a DTensor, say)."""
    if isinstance(obj, torch.Tensor):
        return type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
    if isinstance(obj, dict):
        return all(_all_plain(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_plain(v) for v in obj)
    return True


def _same_state(a: Any, b: Any) -> bool:
    """Whether two nested states are the same: same keys in the same order, the same
    memory viewed the same way for tensors, equal plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and alias_key(a) == alias_key(b)
    if isinstance(a, dict) or isinstance(b, dict):
        return (type(a) is type(b) and list(a) == list(b)
                and all(_same_state(v, b[k]) for k, v in a.items()))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_state(x, y) for x, y in zip(a, b, strict=True)))
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # no plain truth value: not provably the same
        return False


def saved_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a rank saves.

    ZeroRedundancyOptimizer (ZeRO-1) keeps this rank's partition of the state
    in a local optimizer over the parameters it owns: each rank saves that
    partition under the parameters' names, so together the ranks save every
    parameter's state once, and a checkpoint loads under any layout.
    """
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _rename(optim_sd: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    if not names:
        return optim_sd
    state = {names.get(k, k): v for k, v in optim_sd.get("state", {}).items()}
    groups = [{**g, "params": [names.get(n, n) for n in g["params"]]}
              for g in optim_sd.get("param_groups", [])]
    return {**optim_sd, "state": state, "param_groups": groups}


def to_saved_names(model: torch.nn.Module, optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state under the names a whole model gives it.

    A pipeline's last stage holds a copy of GPT's tied embedding as
    `lm_head.weight`; a whole model knows it as `tok_emb.weight`
    (`model.checkpoint_aliases`, set by workers/parallel/engine.py).
    """
    return _rename(optim_sd, getattr(model, "checkpoint_aliases", None) or {})


def from_saved_names(model: torch.nn.Module, optim_sd: dict[str, Any]) -> dict[str, Any]:
    aliases = getattr(model, "checkpoint_aliases", None) or {}
    return _rename(optim_sd, {v: k for k, v in aliases.items()})


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    fqn = {id(p): n for n, p in model.named_parameters()}
    return [[fqn[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _saved_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Under ZeRO-1 the parameter groups list every parameter, not this rank's
    partition: a layout without ZeRO loads them as they are."""
    if saved_optimizer(optimizer) is optimizer:
        return optim_sd
    groups = [{**g, "params": names}
              for g, names in zip(optim_sd["param_groups"], _names(model, optimizer), strict=True)]
    return {**optim_sd, "param_groups": groups}


def read_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`get_state_dict` for the state this rank saves, optimizer keys under whole-model names."""
    model_sd, optim_sd = get_state_dict(model, saved_optimizer(optimizer))
    return model_sd, _saved_groups(model, optimizer, to_saved_names(model, optim_sd))


def write_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Load what `read_states` described (and DCP filled in) into the model and optimizer."""
    local = saved_optimizer(optimizer)
    optim_sd = from_saved_names(model, optim_sd)
    mine = _names(model, local)
    groups = optim_sd.get("param_groups", [])
    if len(groups) == len(mine):
        # The saved groups' settings with this rank's own parameters. DCP keeps one rank's
        # copy of each group (not a tensor: no shards to merge), whose parameter list
        # names that rank's: another pipeline stage's, or another layer split's, or
        # under ZeRO-1 the whole model's rather than this rank's partition.
        optim_sd = {**optim_sd, "param_groups": [
            {**g, "params": names} for g, names in zip(groups, mine, strict=True)]}
    set_state_dict(model, local, model_state_dict=model_sd, optim_state_dict=optim_sd)
