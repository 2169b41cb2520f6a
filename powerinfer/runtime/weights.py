"""Turn GGUF tensors into torch tensors for the runtime."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from ..errors import PowerInferError
from ..formats.gguf_file import GGUFFile


def load_tensor(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in torch order, ``dtype``.

    Zero-copy (a view of the memory map) when the file already stores ``dtype``.
    Raises PowerInferError for a missing tensor or an unsupported GGML type.
    """
    t = g.tensors.get(name)
    if t is None:
        raise PowerInferError(f"{g.path}: tensor {name!r} is missing")
    data = t.data
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        from gguf import quants

        try:
            data = quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise PowerInferError(f"{g.path}: tensor {name!r} has type {t.tensor_type.name}, not supported") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the map is read-only; we never write to weights
        out = torch.from_numpy(data)
    return out if out.dtype == dtype else out.to(dtype)
