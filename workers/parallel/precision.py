"""Mixed precision: autocast for the forward pass, loss scaling for fp16.

Parameters and optimizer state stay fp32 (the master weights); autocast runs
matmuls in bf16 or fp16 and keeps reductions such as the loss in fp32. fp16's
narrow exponent needs dynamic loss scaling: the loss is multiplied before
backward, gradients are divided before the optimizer, and a step whose
gradients overflowed is skipped while the scale halves. A skipped step is
normal for fp16 and must not be taken for a numeric fault.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """What `parallel.precision` asks of a training step.

    Args:
        name: "fp32", "bf16" or "fp16".
        device: Where the model runs.
        autocast: False when FSDP2's mixed-precision policy casts instead.
    """

    def __init__(self, name: str, device: torch.device, autocast: bool = True) -> None:
        self.name = name
        self.dtype = DTYPES.get(name)
        self.device = device
        self.use_autocast = autocast and self.dtype is not None
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> AbstractContextManager:
        if not self.use_autocast:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped when the unscaled gradients overflowed
        self.scaler.update()

    def overflowed(self, norm: float) -> bool:
        """An fp16 overflow: the step is skipped and the scale lowered, not rolled back."""
        return self.scaler is not None and not torch.isfinite(torch.tensor(norm)).item()

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip an overflowed step: the scaler sees the inf and halves its scale."""
        assert self.scaler is not None
        self.scaler.step(optimizer)
        self.scaler.update()
