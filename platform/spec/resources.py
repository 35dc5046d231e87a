"""The job spec's `resources` section: which GPU types a job may run on.

Shared clusters mix GPU generations. A job lists the catalogue types it accepts
(`gpu_types`, any of them; empty: any type) and whether one run may mix them:

- `heterogeneous: false` (the default): every rank on one type. The scheduler
  picks the pool (one type) with enough free GPUs now, else the one whose
  queue ahead of the job is shortest (platform/placement/pools.py);
- `heterogeneous: true`: types may mix. A tensor-parallel group still never
  mixes (it sits in one NVLink island of one node), a pipeline prefers one
  type, and the built-in trainer gives each rank work in proportion to its
  speed (`balance: speed`, workers/parallel/balance.py) so that fast GPUs do
  not wait for slow ones at every step. `balance: even` splits evenly, as a
  homogeneous job does (the comparison bench/hetero.py makes).

Pure: pydantic and the hardware catalogue only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kuangchao.platform.cluster.hardware import CATALOG


class ResourcesSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_types: list[str] = Field(default_factory=list, max_length=16)
    heterogeneous: bool = False
    balance: Literal["speed", "even"] = "speed"

    @field_validator("gpu_types")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        out: list[str] = []
        for name in v:
            key = name.strip().lower()
            if key == "cpu" or key not in CATALOG:
                known = ", ".join(sorted(k for k in CATALOG if k != "cpu"))
                raise ValueError(f"{name!r} is not a GPU type in the catalogue; choose from {known}")
            if key not in out:
                out.append(key)
        return out

    def accepts(self, gpu_type: str | None) -> bool:
        """Whether a node of this type may hold the job's ranks (an untyped node is
        accepted only when the job names no type)."""
        return not self.gpu_types or gpu_type in self.gpu_types
