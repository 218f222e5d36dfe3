"""The gated activation between the two MoE GEMMs, in torch (float32 math, rounded to the activation dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATED_ACTIVATIONS = ("silu", "gelu")

# What each field of vLLM's FusedMoEConfig (_vllm.EXPERT_MATH_FIELDS) adds to the experts' math, for the refusal.
_EXPERT_MATH = {
    "has_bias": "a bias on each expert's GEMMs",
    "swiglu_limit": "a clamp on the gated activation",
    "swiglu_alpha": "a scaled SwiGLU",
    "swiglu_beta": "a shifted SwiGLU",
    "activation_situ_beta": "the SituGLU activation",
    "activation_situ_linear_beta": "the SituGLU activation",
}


def check_expert_math(activation: str, extras: dict[str, object], where: str) -> None:
    """Refuse, at load, a MoE layer whose experts compute more than act(gate) * up with act in GATED_ACTIVATIONS:
    every backend of the plugin computes exactly that, so anything else would be a silently wrong result.
    `extras` is _vllm.layer_expert_math(layer): {vLLM's FusedMoEConfig field: value} away from plain."""
    fix = "use vLLM's own quantization method for this model (without --quantization moe_wna16_plus)"
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"{where}: the experts' activation is {activation!r}; moe_wna16_plus computes the gated "
            f"{' or '.join(GATED_ACTIVATIONS)} (act(gate) * up) only: {fix}"
        )
    if extras:
        what = "; ".join(f"{_EXPERT_MATH.get(k, k)} ({k}={v!r})" for k, v in extras.items())
        raise ValueError(
            f"{where}: this model's experts compute {what}, which moe_wna16_plus's kernels do not (they compute "
            f"{activation}(gate) * up with no bias and no clamp, and would give wrong results): {fix}"
        )


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
