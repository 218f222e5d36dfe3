"""The gated activation between the two MoE GEMMs, in torch (float32 math, rounded to the activation dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATED_ACTIVATIONS = ("silu", "gelu")


def gated_activation(h: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(h[:, :I]) * h[:, I:], computed in float32, returned in h.dtype; h is (T, 2I)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        y = F.silu(gate.float()) * up.float()
    elif activation == "gelu":
        y = F.gelu(gate.float()) * up.float()
    else:
        raise ValueError(f"activation={activation!r} is not supported; supported: {list(GATED_ACTIVATIONS)}")
    if out is None:
        return y.to(h.dtype)
    return out.copy_(y)
