"""Shared set-up for the kernel tests: the Triton interpreter switch and the MoE input factory.

TRITON_INTERPRET must be set before triton is imported (triton.jit reads it when a
kernel is defined), so it is set here, at collection time, unless the caller chose.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_wna16_plugin import packing  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs a Triton kernel; CPU-safe under TRITON_INTERPRET=1")
    config.addinivalue_line("markers", "slow: one of the longer interpreter cases")


@dataclass
class MoEProblem:
    """Random kernel-layout MoE weights, activations and routing (see make_moe_problem)."""

    x: torch.Tensor
    w13: packing.KernelWeights
    w2: packing.KernelWeights
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    bits: int

    def args(self):
        return (
            self.x,
            self.w13.qweight,
            self.w2.qweight,
            self.w13.scales,
            self.w2.scales,
            self.topk_weights,
            self.topk_ids,
        )

    def kwargs(self):
        return dict(bits=self.bits, w13_qzeros=self.w13.qzeros, w2_qzeros=self.w2.qzeros)


def quantized_experts(E, N, K, bits, group_size, zp, dtype, gen, exact_scales=True):
    """Random float weights (E, N, K) -> RTN (real zero points when zp) -> random scales -> kernel layout.

    The scales are redrawn at random around RTN's. With exact_scales they are rounded to
    4 significant bits (int4) or a power of two (int8), so every dequantized weight
    (q - z) * s is exact in bf16/fp16: the kernel's one extra rounding point (w cast to
    the activation dtype, as in vLLM's kernel; the float32 reference has none) is then
    exact, and kernel-vs-reference differences are accumulation order only. Without
    it, that rounding is amplified through the bf16 intermediate and activation.
    """
    w = torch.randn(E, N, K, generator=gen) / K**0.5
    qw = packing.quantize_rtn(w, bits, group_size, zp)
    s = qw.scales * (0.5 + torch.rand(qw.scales.shape, generator=gen))
    if exact_scales:
        mant, exp = torch.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
        keep = 16 if bits == 4 else 1  # 4 significant bits, or a bare power of two
        s = torch.ldexp(torch.ceil(mant * keep) / keep, exp)
    qw.scales = s
    return packing.to_kernel_layout(qw, dtype)


def make_moe_problem(
    *,
    M,
    H,
    inter=None,
    I=None,  # noqa: E741 - alias of inter (tests/kernels/test_backends_gpu.py spells it I)
    E,
    top_k,
    bits,
    gs1,
    gs2=None,
    zp=False,
    dtype=torch.bfloat16,
    num_global_experts=None,
    seed=0,
    exact_scales=True,
) -> MoEProblem:
    """inter: the intermediate size I. gs1/gs2: group sizes of GEMM1 (K=H) and GEMM2 (K=I), -1 = channel-wise.

    Routing draws top_k distinct experts per token out of num_global_experts (default E)
    with softmax weights; the weights have E experts (the local ones).
    """
    inter = I if inter is None else inter
    if inter is None:
        raise ValueError("make_moe_problem needs inter (or its alias I), the intermediate size")
    gen = torch.Generator().manual_seed(seed)
    gs2 = gs1 if gs2 is None else gs2
    w13 = quantized_experts(E, 2 * inter, H, bits, gs1, zp, dtype, gen, exact_scales)
    w2 = quantized_experts(E, H, inter, bits, gs2, zp, dtype, gen, exact_scales)
    x = torch.randn(M, H, generator=gen).to(dtype)
    # routing draws come from the same generator: a test's data never depends on test order
    logits = torch.randn(M, num_global_experts or E, generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return MoEProblem(x, w13, w2, topk_weights, topk_ids.to(torch.int32), bits)


def assert_close_scaled(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """|out - ref| <= atol + rtol*|ref|, atol = ref.abs().max() * 2**-7 (bf16) or 2**-9 (fp16)."""
    assert not out.isnan().any(), f"{what}: NaN in the output (an element was never written)"
    o, r = out.float(), ref.float()
    scale = r.abs().max().item()
    atol, rtol = (scale * 2**-7, 1e-2) if dtype == torch.bfloat16 else (scale * 2**-9, 4e-3)
    err = (o - r).abs()
    rel_rms = ((o - r).norm() / r.norm().clamp(min=1e-12)).item()
    bad = err > atol + rtol * r.abs()
    assert not bad.any(), (
        f"{what}: max |err|={err.max().item():.4g} (atol={atol:.4g}, rtol={rtol}), "
        f"rel rms={rel_rms:.3g}, {int(bad.sum())} of {bad.numel()} outside"
    )


@pytest.fixture
def td_decisions(monkeypatch):
    """Records the TDDecision of every GEMM the launcher runs."""
    from vllm_wna16_plugin.kernels.triton import fused_moe

    seen = []
    real = fused_moe.invoke_wna16_gemm

    def spy(*args, td, **kwargs):
        seen.append(td)
        return real(*args, td=td, **kwargs)

    monkeypatch.setattr(fused_moe, "invoke_wna16_gemm", spy)
    return seen
