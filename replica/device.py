"""Where a model computes: the CPU, or the CUDA device this process was given.

A process that asked for a GPU and whose torch sees none (a CPU wheel, a node without a driver)
is refused by name rather than left to compute on the CPU unnoticed. Torch is imported on use,
so configs can name the precisions without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Precisions of weights and KV cache; auto: bfloat16 on a GPU, float32 on CPU."""


def compute_device(cuda: bool, dtype: str, asked_by: str) -> tuple[torch.device, torch.dtype]:
    """The device and precision; `asked_by` names the setting that asked for `cuda` (errors)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = torch.device("cpu")
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{asked_by}, but torch in this process sees no CUDA device (torch "
                f"{torch.__version__}: a CPU wheel, or a node without a GPU driver)"
            )
        device = torch.device("cuda")
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)
