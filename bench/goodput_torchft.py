"""Ray Train's torchft backend for bench/goodput.py's `--ray-mode torchft`, with one change:
its lighthouse actor asks for no CPU.

Ray Train (ray/train/v2/torch/torchft_config.py, `_TorchftBackend`) starts the torchft
lighthouse as an actor pinned to its controller's node (`NodeAffinitySchedulingStrategy`,
soft=False) with Ray's default of one CPU. The controller runs on the driver's node, here
the head, which kuangchao's clusters (and many production ones) start with `--num-cpus=0`,
so the lighthouse can never be scheduled and `fit()` fails at once ("The actor is not
schedulable"). The lighthouse is a small Rust server; asking for no CPU is what it needs.
Everything else is Ray Train's own code. Imported by name in Ray Train's controller
(the config is pickled), so it lives in its own module; it needs `RAY_TRAIN_V2_ENABLED=1`
before `ray.train` is imported, as bench/goodput.py sets.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train.v2.torch.torchft_config import (
    LighthouseServerActor,
    TorchftConfig,
    _TorchftBackend,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class ZeroCpuLighthouseBackend(_TorchftBackend):
    """`_TorchftBackend` whose lighthouse actor holds no CPU."""

    def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
        if self.lighthouse_actor is not None:
            return ray.get(self.lighthouse_actor.address.remote())
        kwargs = backend_config.lighthouse_kwargs
        if "bind" not in kwargs:
            kwargs = {"bind": "[::]:0"} | kwargs
        self.lighthouse_actor = LighthouseServerActor.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(lighthouse_kwargs=kwargs)
        return ray.get(self.lighthouse_actor.address.remote())


class ZeroCpuTorchftConfig(TorchftConfig):
    """`TorchftConfig` with `ZeroCpuLighthouseBackend`."""

    @property
    def backend_cls(self):
        return ZeroCpuLighthouseBackend
