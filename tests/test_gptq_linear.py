"""Linear layers of asymmetric GPTQ checkpoints (gptq_linear.py): conversion, routing, loading, refusals.

The references here are written from the layouts, not from the plugin's packing.py: GPTQ packs along K
(qweight) and N (qzeros), value i of an int32 word at bits [i*b, (i+1)*b), v1 storing zero - 1; vLLM's
MarlinLinearKernel permutes scales and zero points in blocks of 64 columns, interleaves zero points and
packs them along N (marlin_utils.marlin_permute_scales / marlin_zero_points). On CPU, vLLM's own
MarlinLinearKernel prepares the layer with its weight repack (a CUDA op) replaced by the identity, so
the repacked scales and zero points are vLLM's; the qweight repack and the GEMM run in the GPU test.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vllm_wna16_plugin import _vllm, gptq_linear
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

QKV = "model.layers.0.self_attn.qkv_proj"
MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _raw(bits=4, gs=32, sym=False, v2=False, desc_act=False, **more):
    return {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq_v2" if v2 else "gptq", **more}  # fmt: skip


def _scheme(bits=4, gs=32, v2=False, desc_act=False):
    return WNA16Scheme(bits, gs, True, PackFormat.GPTQ, desc_act=desc_act, zero_point_offset=0 if v2 else 1)


# ---------------------------------------------------------------- independent references


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of unsigned `bits`-wide values along `dim`: value i of a word at bits [i*bits, (i+1)*bits)."""
    v = values.numpy().astype(np.uint64)
    v = np.moveaxis(v, dim, 0)
    pf = 32 // bits
    words = np.zeros((v.shape[0] // pf, *v.shape[1:]), dtype=np.uint64)
    for i in range(pf):
        words |= v[i::pf] << np.uint64(bits * i)
    return torch.from_numpy(np.moveaxis(words.astype(np.uint32).view(np.int32), 0, dim).copy())


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    w = np.moveaxis(words.numpy().view(np.uint32).astype(np.uint64), dim, 0)
    pf = 32 // bits
    out = np.zeros((w.shape[0] * pf, *w.shape[1:]), dtype=np.int64)
    for i in range(pf):
        out[i::pf] = (w >> np.uint64(bits * i)) & np.uint64((1 << bits) - 1)
    return torch.from_numpy(np.moveaxis(out, 0, dim).copy())


def _truth(n: int, k: int, bits: int, gs: int, v2: bool, seed: int):
    """Random q (N, K), zero points (N, G) and float16 scales (N, G), with the edge zeros of the format."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else k // gs
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    lo, hi = (0, (1 << bits) - 1) if v2 else (1, (1 << bits) - 1)  # v1 cannot store zero 0 (stored -1)
    zeros = torch.randint(lo, hi + 1, (n, groups), generator=g)
    zeros[0, 0], zeros[-1, -1] = lo, hi
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half()
    return q, zeros, scales


def _dequant(q, zeros, scales, gs):
    """w[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)], float32 (N, K)."""
    k = q.shape[1]
    group = torch.arange(k) // (k if gs == -1 else gs)
    return (q - zeros[:, group]).float() * scales.float()[:, group]


def _gptq(q, zeros, scales, bits, v2):
    """GPTQ checkpoint tensors: qweight (K/pf, N) along K, qzeros (G, N/pf) along N (v1: zero - 1), scales (G, N)."""
    return {
        "qweight": _pack(q.T.contiguous(), bits, 0),
        "qzeros": _pack((zeros - (0 if v2 else 1)).T.contiguous(), bits, 1),
        "scales": scales.T.contiguous(),
        "g_idx": (torch.arange(q.shape[1]) // (q.shape[1] // zeros.shape[1])).to(torch.int32),
    }


# Marlin's layout of scales and zero points (vLLM marlin_utils): per block of 64 columns, column
# i*8 + j holds column i + 8*j; channel-wise scales use the 32-column "single" permutation; zero points
# are then interleaved per word (4-bit: 0,2,4,6,1,3,5,7; 8-bit: 0,2,1,3) and packed along N.
SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]
SCALE_PERM_SINGLE = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
ZP_INTERLEAVE = {4: [0, 2, 4, 6, 1, 3, 5, 7], 8: [0, 2, 1, 3]}


def _undo(t: torch.Tensor, perm: list[int], n: int) -> torch.Tensor:
    return t.reshape(-1, len(perm))[:, np.argsort(perm)].reshape(-1, n)


def _marlin_dequant(layer, bits: int, gs: int, k: int, n: int) -> torch.Tensor:
    """(N, K) float32 of a layer after vLLM's Marlin preparation with the qweight repack left out (qweight
    stays GPTQ, padded): scales and zero points read back through the inverse of Marlin's layout."""
    q = _unpack(layer.qweight.data, bits, 0)  # (Kp, Np)
    kp, np_ = q.shape
    grouped = gs != -1 and gs < kp
    scales = _undo(layer.scales.data.float(), SCALE_PERM if grouped else SCALE_PERM_SINGLE, np_)
    zeros = _unpack(layer.qzeros.data, bits, 1)  # (Gp, Np) interleaved and permuted
    zeros = _undo(_undo(zeros, ZP_INTERLEAVE[bits], np_), SCALE_PERM, np_)
    group = torch.arange(kp) // (kp if gs == -1 else gs)
    w = (q - zeros[group]).float() * scales[group]
    return w[:k, :n].T


# ---------------------------------------------------------------- (a) conversion


CONVERSIONS = [
    pytest.param(4, 32, False, id="int4-gs32-v1"),
    pytest.param(4, 128, True, id="int4-gs128-v2"),
    pytest.param(4, -1, False, id="int4-channelwise-v1"),
    pytest.param(4, 64, True, id="int4-gs64-v2"),
    pytest.param(8, 32, False, id="int8-gs32-v1"),
    pytest.param(8, -1, True, id="int8-channelwise-v2"),
]


@pytest.mark.parametrize("bits, gs, v2", CONVERSIONS)
def test_marlin_zero_point_input_is_the_mp_linear_contract_exactly(bits, gs, v2):
    """The zp parameter vLLM's MarlinLinearKernel reads: its .t() is (G, N/pf) packed along N, true zeros."""
    n, k = 192, 256
    q, zeros, scales = _truth(n, k, bits, gs, v2, seed=bits * 100 + gs)
    t = _gptq(q, zeros, scales, bits, v2)
    zp = gptq_linear.marlin_zero_point_input(_scheme(bits, gs, v2), t["qzeros"], "x.qzeros")
    assert zp.dtype == torch.int32 and zp.shape == (n * bits // 32, zeros.shape[1])
    read = _unpack(zp.t().contiguous(), bits, 1)  # (G, N)
    assert torch.equal(read, zeros.T)
    # uint zero-point semantics on the unchanged qweight and scales give the checkpoint's weights exactly
    w = (_unpack(t["qweight"], bits, 0) - read[torch.arange(k) // (k if gs == -1 else gs)]).float()
    w = w * t["scales"].float()[torch.arange(k) // (k if gs == -1 else gs)]
    assert torch.equal(w.T, _dequant(q, zeros, scales, gs))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_v1_zero_it_cannot_represent_is_refused_naming_the_tensor(bits):
    q, zeros, scales = _truth(64, 128, bits, 32, True, seed=3)
    zeros = zeros.clamp(max=(1 << bits) - 2)
    zeros[17, 2] = (1 << bits) - 1  # written as v2 (stored as it is), read as v1: zero 2**bits
    t = _gptq(q, zeros, scales, bits, v2=True)
    msg = rf"checkpoint tensor m\.k_proj\.qzeros: stored zero point {(1 << bits) - 1} at output channel 17, group 2"
    with pytest.raises(ValueError, match=msg + ".*gptq_v2"):
        gptq_linear.marlin_zero_point_input(_scheme(bits, 32, v2=False), t["qzeros"], "m.k_proj.qzeros")


# ---------------------------------------------------------------- vLLM layers on CPU


@pytest.fixture
def on_cuda(monkeypatch):
    """The plugin and vLLM's Marlin rules see an NVIDIA sm90 (vLLM's rules then run for real on CPU)."""
    import vllm.model_executor.kernels.linear  # noqa: F401 - imported on CPU first: vLLM probes the
    import vllm.model_executor.layers.linear  # noqa: F401   platform while it imports these
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    get_quantization_config("moe_wna16_plus")  # imports every quantization config module
    monkeypatch.setattr(_vllm, "platform_summary", lambda: ("cuda", 90))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda *args: DeviceCapability(9, 0))
    gptq_linear._LOGGED.clear()


@pytest.fixture
def marlin_on_cpu(on_cuda, monkeypatch):
    """vLLM's MarlinLinearKernel preparing a layer on CPU: its qweight repack (CUDA) is the identity."""
    import vllm._custom_ops as ops
    from vllm.model_executor.kernels.linear.mixed_precision import marlin

    monkeypatch.setattr(ops, "gptq_marlin_repack", lambda q, *args, **kwargs: q.clone())
    if hasattr(marlin, "marlin_make_workspace_new"):  # 0.26-0.30: sized by the GPU's SM count (0.29-0.30: existing=)
        monkeypatch.setattr(
            marlin, "marlin_make_workspace_new", lambda device, *a, **k: torch.zeros(1, dtype=torch.int)
        )


def _config(raw):
    from vllm.model_executor.layers.quantization import get_quantization_config

    cfg = get_quantization_config("moe_wna16_plus").from_config(raw)
    cfg.packed_modules_mapping = MAPPING
    return cfg


@pytest.fixture
def tp(monkeypatch):
    """tp(size, rank): vLLM's linear layers built next see this tensor-parallel rank."""
    import vllm.model_executor.layers.linear as linear

    def set_tp(size, rank):
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)

    return set_tp


LAYERS = [
    # (kind, K, output shards (name, N), TP); row: K split across ranks, the others: N
    pytest.param("qkv", 128, (("q", 128), ("k", 64), ("v", 64)), 1, id="qkv-tp1"),
    pytest.param("qkv", 128, (("q", 128), ("k", 64), ("v", 64)), 2, id="qkv-tp2"),
    pytest.param("gate_up", 256, ((0, 128), (1, 128)), 2, id="gate_up-tp2"),
    pytest.param("row", 256, ((None, 192),), 2, id="o_proj-row-tp2"),
    pytest.param("row", 128, ((None, 96),), 1, id="row-n96-padded"),  # N=96: Marlin pads N to 128
]
SCHEMES = [
    pytest.param(4, 32, False, id="gs32-v1"),
    pytest.param(4, 64, True, id="gs64-v2"),
    pytest.param(4, -1, False, id="channelwise-v1"),
]


def _build(kind, k, shards, cfg, dtype):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if kind == "qkv":  # head size 32: 4 query heads, 2 key/value heads
        return QKVParallelLinear(k, 32, 4, 2, bias=False, params_dtype=dtype, quant_config=cfg, prefix=QKV)
    if kind == "gate_up":
        return MergedColumnParallelLinear(k, [n for _, n in shards], bias=False, params_dtype=dtype, quant_config=cfg,
                                          prefix="model.layers.0.mlp.gate_up_proj")  # fmt: skip
    return RowParallelLinear(k, shards[0][1], bias=False, params_dtype=dtype, quant_config=cfg,
                             prefix="model.layers.0.self_attn.o_proj")  # fmt: skip


def _load_and_expect(layer, kind, k, shards, bits, gs, v2, size, rank, seed):
    """Loads every shard's checkpoint tensors through the parameters' weight loaders; returns this rank's
    expected (N_rank, K_rank) float32 weights."""
    params = dict(layer.named_parameters())
    expected = []
    for i, (shard_id, n) in enumerate(shards):
        q, zeros, scales = _truth(n, k, bits, gs, v2, seed=seed + i)
        w = _dequant(q, zeros, scales.to(params["scales"].dtype), gs)  # the layer keeps scales in its dtype
        for name, tensor in _gptq(q, zeros, scales, bits, v2).items():
            if name in params:
                loader = params[name].weight_loader
                loader(params[name], tensor) if shard_id is None else loader(params[name], tensor, shard_id)
        if kind == "row":
            expected.append(w[:, rank * k // size : (rank + 1) * k // size])
        else:
            expected.append(w[rank * n // size : (rank + 1) * n // size])
    return torch.cat(expected)


@pytest.mark.parametrize("bits, gs, v2", SCHEMES)
@pytest.mark.parametrize("kind, k, shards, size", LAYERS)
def test_merged_and_sharded_layers_load_and_convert_exactly_for_marlin(
    vllm_cpu, marlin_on_cpu, tp, kind, k, shards, size, bits, gs, v2
):
    cfg = _config(_raw(bits, gs, v2=v2))
    for rank in range(size):
        tp(size, rank)
        layer = _build(kind, k, shards, cfg, torch.bfloat16)
        method = layer.quant_method
        assert type(method).__name__ == "GPTQAsymLinearMethod" and method.kernel == gptq_linear.MARLIN
        expected = _load_and_expect(layer, kind, k, shards, bits, gs, v2, size, rank, seed=7)
        method.process_weights_after_loading(layer)
        got = _marlin_dequant(layer, bits, gs, method.shape.k_part, method.shape.n_part)
        assert torch.equal(got, expected), f"rank {rank}: max |diff| {(got - expected).abs().max():.3g}"


def test_a_v1_zero_in_one_shard_of_a_merged_layer_is_refused_naming_the_checkpoint_tensor(vllm_cpu, on_cuda):
    layer = _build("qkv", 128, None, _config(_raw()), torch.bfloat16)
    q, zeros, scales = _truth(64, 128, 4, 32, True, seed=1)
    zeros = zeros.clamp(max=14)
    zeros[5, 3] = 15  # written as v2, read as v1: stored 15 is zero 16
    bad = _gptq(q, zeros, scales, 4, v2=True)["qzeros"]
    msg = re.escape("model.layers.0.self_attn.k_proj.qzeros: stored zero point 15 at output channel 5, group 3")
    with pytest.raises(ValueError, match=msg):
        layer.qzeros.weight_loader(layer.qzeros, bad, "k")


def _exllama_reference_ops(seen):
    """vLLM's exllama op semantics in torch: GPTQ tensors as stored, v1 zero points read as stored + 1."""

    def gemm(x, qweight, qzeros, scales, g_idx, use_exllama, use_v2_format, bits):
        seen.append((use_exllama, use_v2_format, g_idx.numel()))
        k, groups = qweight.shape[0] * 32 // bits, scales.shape[0]
        group = torch.arange(k) // (k // groups)
        zeros = _unpack(qzeros, bits, 1) + (0 if use_v2_format else 1)
        w = (_unpack(qweight, bits, 0) - zeros[group]).float() * scales.float()[group]
        return (x.float() @ w).to(x.dtype)

    return _vllm.ExllamaOps(True, gemm, lambda qweight, perm, bits: None)


@pytest.mark.parametrize("bits, gs, v2", [pytest.param(8, 32, False, id="int8-v1"), pytest.param(8, -1, True,
                         id="int8-channelwise-v2"), pytest.param(4, 256, False, id="int4-gs256-v1")])  # fmt: skip
def test_layers_marlin_cannot_take_run_on_exllama_in_float16(vllm_cpu, on_cuda, tp, monkeypatch, bits, gs, v2):
    """int8 and group 256 have no Marlin kernel with zero points: float16 layers go to vLLM's exllama op, which
    gets the checkpoint's own tensors and the v1/v2 flag (its semantics in torch here; the op in the GPU test)."""
    seen = []
    monkeypatch.setattr(_vllm, "gptq_exllama_ops", lambda: _exllama_reference_ops(seen))
    tp(1, 0)
    shards = (("q", 128), ("k", 64), ("v", 64))
    layer = _build("qkv", 512, None, _config(_raw(bits, gs, v2=v2)), torch.float16)
    assert layer.quant_method.kernel == gptq_linear.EXLLAMA
    w = _load_and_expect(layer, "qkv", 512, shards, bits, gs, v2, 1, 0, seed=11)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).half()
    out = layer.quant_method.apply(layer, x)
    assert seen == [(True, v2, 0)]
    torch.testing.assert_close(out.float(), (x.float() @ w.T).half().float(), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- (b) routing and refusals


def _plain_layer(prefix):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(128, 256, bias=False, quant_config=None, prefix=prefix)


def test_routing_asymmetric_gptq_to_the_plugin_symmetric_to_vllm_excluded_unquantized(vllm_cpu, monkeypatch):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = _plain_layer(QKV)
    ours = gptq_linear.linear_method_class()
    asym = _config(_raw(dynamic={"-:.*mlp\\.gate$": {}}))
    method = asym.get_quant_method(layer, QKV)
    assert isinstance(method, ours) and method.shard_names == ("q_proj", "k_proj", "v_proj")
    assert isinstance(asym.get_quant_method(layer, "model.layers.0.mlp.gate"), UnquantizedLinearMethod)
    # symmetric GPTQ keeps vLLM's in-tree config (AutoGPTQConfig), whatever it answers
    sym = _config(_raw(sym=True))
    assert type(sym._delegate()).__name__ == "AutoGPTQConfig"
    sentinel = object()
    monkeypatch.setattr(type(sym._delegate()), "get_quant_method", lambda self, layer, prefix: sentinel)
    assert sym.get_quant_method(layer, QKV) is sentinel
    # a dynamic rule that makes one module asymmetric sends that module, and only it, to the plugin
    mixed = _config(_raw(sym=True, dynamic={"+:.*o_proj": {"sym": False}}))
    monkeypatch.setattr(type(mixed._delegate()), "get_quant_method", lambda self, layer, prefix: sentinel)
    assert isinstance(mixed.get_quant_method(layer, "model.layers.0.self_attn.o_proj"), ours)
    assert mixed.get_quant_method(layer, QKV) is sentinel


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                     id="awq"),
        pytest.param({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                      "config_groups": {"g": {"targets": ["Linear"], "input_activations": None, "weights": {
                          "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                          "group_size": 32}}}}, id="ct-asym"),
    ],
)  # fmt: skip
def test_awq_and_compressed_tensors_linears_stay_with_vllm(vllm_cpu, raw):
    method = _config(raw).get_quant_method(_plain_layer(QKV), QKV)
    assert type(method).__module__.startswith("vllm.") and not isinstance(method, gptq_linear.linear_method_class())


def test_on_cpu_the_layer_is_refused_naming_it_and_the_fix(vllm_cpu):
    from vllm.model_executor.layers.linear import RowParallelLinear

    msg = (r"linear layer 'model\.layers\.3\.self_attn\.o_proj' is stored as asymmetric GPTQ \(quantization_config"
           r"\.sym=false, bits=4, group_size=32, desc_act=false\).*marlin: needs an NVIDIA GPU \(platform is cpu\)"
           r".*re-export the checkpoint with sym=true")  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        RowParallelLinear(128, 256, bias=False, quant_config=_config(_raw()), prefix="model.layers.3.self_attn.o_proj")


BF16, FP16 = torch.bfloat16, torch.float16
SHAPE = gptq_linear.LinearShape(k_full=1024, n_full=512, k_part=1024, n_part=512)


@pytest.mark.parametrize(
    "scheme, dtype, sm, kernel, why",
    [
        pytest.param(_scheme(4, 128), BF16, 90, "marlin", None, id="int4-gs128-bf16"),
        pytest.param(_scheme(4, -1, v2=True), FP16, 80, "marlin", None, id="int4-channelwise-fp16"),
        pytest.param(_scheme(8, 128), FP16, 90, "exllama", r"Quant type \(uint8\) not supported", id="int8-fp16"),
        pytest.param(_scheme(4, 256), FP16, 90, "exllama", r"Group size \(256\) not supported", id="gs256-fp16"),
        pytest.param(_scheme(4, 128), FP16, 70, "exllama", r"needs compute capability 75\+", id="sm70-fp16"),
        pytest.param(_scheme(8, 128), BF16, 90, None, r"Quant type \(uint8\).*exllama: runs float16 only",
                     id="int8-bf16-refused"),
        pytest.param(_scheme(4, 128, desc_act=True), BF16, 90, None, r"marlin: has no act-order kernel",
                     id="act-order-bf16-refused"),
    ],
)  # fmt: skip
def test_kernel_choice_follows_vllms_marlin_rules_then_exllama(on_cuda, scheme, dtype, sm, kernel, why):
    if kernel is None:
        with pytest.raises(ValueError, match=rf"linear layer 'L'.*{why}.*--dtype float16"):
            gptq_linear.choose_kernel(scheme, SHAPE, dtype, "L", platform=("cuda", sm))
        return
    assert gptq_linear.choose_kernel(scheme, SHAPE, dtype, "L", platform=("cuda", sm)) == kernel
    verdicts = gptq_linear.kernel_verdicts(scheme, SHAPE, dtype, platform=("cuda", sm))
    assert (verdicts["marlin"] is None) == (why is None)
    if why is not None:
        assert re.search(why, verdicts["marlin"])


def test_act_order_runs_on_exllama_only_where_vllm_keeps_linear_g_idx(on_cuda):
    scheme = _scheme(4, 128, desc_act=True)
    if gptq_linear.exllama_act_order():  # vLLM 0.26-0.29
        assert gptq_linear.choose_kernel(scheme, SHAPE, FP16, "L", platform=("cuda", 90)) == "exllama"
    else:
        with pytest.raises(ValueError, match=r"exllama: vLLM .* runs no act order in linear layers \(desc_act=true\)"):
            gptq_linear.choose_kernel(scheme, SHAPE, FP16, "L", platform=("cuda", 90))


@pytest.mark.parametrize(
    "shape, message",
    [
        pytest.param(gptq_linear.LinearShape(1024, 512, 512 + 32, 512), r"K=544 per rank .* not a multiple of "
                     r"group_size=128.*divides K / group_size = 8", id="tp-cuts-a-group"),
        pytest.param(gptq_linear.LinearShape(1024, 516, 1024, 516), r"K=1024 and N=516 per rank must be multiples of 8",
                     id="n-not-packable"),
    ],
)  # fmt: skip
def test_shapes_gptq_cannot_hold_are_refused_naming_the_layer(shape, message):
    with pytest.raises(ValueError, match=rf"linear layer 'model\.x' \(gptq int4 group 128 asymmetric\): {message}"):
        gptq_linear.choose_kernel(_scheme(4, 128), shape, BF16, "model.x", platform=("cuda", 90))


def test_the_kernel_is_logged_once(on_cuda, monkeypatch):
    lines = []
    monkeypatch.setattr(gptq_linear.logger, "info", lambda msg, *args: lines.append(msg % args))
    for prefix in ("a", "b"):
        gptq_linear.choose_kernel(_scheme(4, 128), SHAPE, BF16, prefix, platform=("cuda", 90))
    assert lines == ["moe_wna16_plus: asymmetric GPTQ linear layers run on vLLM's Marlin kernel with integer zero "
                     "points (MarlinLinearKernel, uint4), first a"]  # fmt: skip


# ---------------------------------------------------------------- (d) the GPU


GPU_CASES = [
    # (bits, group size, v2, desc_act, dtype, K, N): the kernel follows from choose_kernel
    pytest.param(4, 128, False, False, BF16, 1024, 768, id="marlin-int4-gs128-v1-bf16"),
    pytest.param(4, 32, True, False, FP16, 512, 256, id="marlin-int4-gs32-v2-fp16"),
    pytest.param(4, -1, False, False, BF16, 768, 96, id="marlin-int4-channelwise-n96-padded"),
    pytest.param(8, 128, False, False, FP16, 1024, 512, id="exllama-int8-gs128-v1"),
    pytest.param(8, -1, True, False, FP16, 512, 256, id="exllama-int8-channelwise-v2"),
    pytest.param(4, 256, True, False, FP16, 1024, 256, id="exllama-int4-gs256"),
    pytest.param(4, 128, False, True, FP16, 512, 256, id="exllama-act-order"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bits, gs, v2, desc_act, dtype, k, n", GPU_CASES)
@pytest.mark.parametrize("m", [1, 7, 64])
def test_gpu_layer_matches_a_float_matmul_of_the_dequantized_weights(vllm_cpu, bits, gs, v2, desc_act, dtype, k, n, m):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from tests.kernels.conftest import assert_close_scaled

    if desc_act and not gptq_linear.exllama_act_order():
        pytest.skip(f"vLLM {_vllm.vllm_version()} runs no act order in linear layers")
    layer = ReplicatedLinear(k, n, bias=True, params_dtype=dtype, quant_config=_config(_raw(bits, gs, v2=v2,
                             desc_act=desc_act)), prefix="model.layers.0.self_attn.o_proj")  # fmt: skip
    q, zeros, scales = _truth(n, k, bits, gs, v2, seed=m + bits)
    t = _gptq(q, zeros, scales, bits, v2)
    w = _dequant(q, zeros, scales, gs)
    if desc_act:  # act order: row k in group g_idx[k]
        gen = torch.Generator().manual_seed(5)
        t["g_idx"] = (torch.randperm(k, generator=gen) // gs).to(torch.int32)
        w = (q - zeros[:, t["g_idx"].long()]).float() * scales.float()[:, t["g_idx"].long()]
    params = dict(layer.named_parameters())
    for name, tensor in t.items():
        if name in params:
            params[name].weight_loader(params[name], tensor)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    layer.bias.data.copy_(bias)
    layer.to("cuda")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    out, _ = layer(x)
    ref = x.float() @ w.cuda().T + bias.cuda().float()
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), ref.cpu(), dtype, f"{layer.quant_method.kernel} M={m}")
