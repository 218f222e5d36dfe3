"""The plugin's FusedMoE method on CPU: real vLLM layer, real weight loader, every checkpoint format.

Checkpoint tensors are built from random float weights through packing.py (the
code the tiny checkpoints use), loaded through vLLM's RoutedExperts.load_weights,
and the layer's forward (reference backend) is compared with the float math on
the dequantized weights. TP is simulated rank by rank: the partial outputs of
the ranks must sum to the full layer's output.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_moe_layer, simulate_ep_rank
from vllm_wna16_plugin import _vllm, packing
from vllm_wna16_plugin.reference import fused_moe_ref

E, H, I, TOP_K = 4, 128, 128, 2

RAW = {
    "gptq": lambda bits, gs, sym, v2=False: {
        "quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": False,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    },
    "awq": lambda bits, gs, sym, v2=False: {
        "quant_method": "awq", "bits": bits, "group_size": gs, "zero_point": not sym, "version": "gemm",
    },
    "compressed-tensors": lambda bits, gs, sym, v2=False: {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
            "strategy": "channel" if gs in (-1, None) else "group", "group_size": gs, "actorder": None}}},
        "ignore": ["lm_head"],
    },
}  # fmt: skip


def _checkpoint_tensors(fmt: str, qw: packing.QuantizedWeight, v2: bool = False) -> dict[str, torch.Tensor]:
    if fmt == "gptq":
        out = packing.pack_gptq(qw, zero_point_offset=0 if v2 else 1)
        out["scales"] = out["scales"].half()
        out["g_idx"] = torch.arange(qw.q.shape[-1], dtype=torch.int32) // qw.group_size
        return out
    if fmt == "awq":
        out = packing.pack_awq(qw)
        out["scales"] = out["scales"].half()
        return out
    out = packing.pack_compressed_tensors(qw)
    out["weight_scale"] = out["weight_scale"].bfloat16()
    return out


def _random_experts(bits, gs, sym, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    q13 = packing.quantize_rtn(w13, bits, gs, has_zero_point=not sym)
    q2 = packing.quantize_rtn(w2, bits, gs, has_zero_point=not sym)
    # Checkpoint scales are fp16/bf16: round them now so the reference sees the same values.
    for q in (q13, q2):
        q.scales = q.scales.half().float()
    return q13, q2


def _expert_slice(qw: packing.QuantizedWeight, e: int, rows: slice | None = None) -> packing.QuantizedWeight:
    rows = rows or slice(None)
    z = None if qw.zeros is None else qw.zeros[e, rows]
    return packing.QuantizedWeight(qw.q[e, rows], qw.scales[e, rows], z, qw.bits, qw.group_size)


def _weights(fmt, q13, q2, v2=False, names=("gate_proj", "up_proj", "down_proj")):
    out = []
    for e in range(E):
        parts = (
            (names[0], _expert_slice(q13, e, slice(0, I))),
            (names[1], _expert_slice(q13, e, slice(I, 2 * I))),
            (names[2], _expert_slice(q2, e)),
        )
        for proj, qw in parts:
            for key, t in _checkpoint_tensors(fmt, qw, v2).items():
                out.append((f"{e}.{proj}.{key}", t))
    return out


def _build(vllm_cpu, raw, tp_size=1):
    return build_moe_layer(vllm_cpu, raw, E=E, H=H, I=I, top_k=TOP_K, tp_size=tp_size)


def _forward(layer, x, topk_weights, topk_ids):
    return layer.quant_method.apply(layer, x, topk_weights, topk_ids, None, None)


def _routing(seed, m=6):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, H, generator=g)).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)])
    w = torch.rand(m, TOP_K, generator=g)
    return x, w, ids


def _assert_close(out, ref, what):
    err = (out.float() - ref.float()).abs().max().item()
    tol = ref.float().abs().max().item() * 2**-6
    assert not out.isnan().any(), f"{what}: NaN in output"
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


CASES = [
    pytest.param("gptq", 4, 32, True, False, id="gptq-int4-gs32-sym"),  # Qwen3.5-35B-A3B's scheme
    pytest.param("gptq", 4, 128, False, False, id="gptq-int4-gs128-asym-v1"),
    pytest.param("gptq", 4, 64, False, True, id="gptq-int4-gs64-asym-v2"),
    pytest.param("gptq", 8, 128, True, False, id="gptq-int8-gs128-sym"),
    pytest.param("gptq", 4, -1, True, False, id="gptq-int4-channelwise"),
    pytest.param("awq", 4, 128, False, False, id="awq-int4-gs128"),
    pytest.param("awq", 4, 32, False, False, id="awq-int4-gs32"),
    pytest.param("compressed-tensors", 4, None, True, False, id="ct-int4-channel-null"),  # Mixtral-8x22B / gemma
    pytest.param("compressed-tensors", 4, 128, False, False, id="ct-int4-gs128-asym"),
    pytest.param("compressed-tensors", 8, 64, True, False, id="ct-int8-gs64-sym"),
]


@pytest.mark.parametrize("fmt, bits, gs, sym, v2", CASES)
def test_layer_loads_and_matches_float_reference(vllm_cpu, fmt, bits, gs, sym, v2):
    q13, q2 = _random_experts(bits, -1 if gs is None else gs, sym, seed=bits * 1000 + (gs or 7))
    layer = _build(vllm_cpu, RAW[fmt](bits, gs, sym, v2))
    loaded = list(layer.load_weights(_weights(fmt, q13, q2, v2)))
    assert loaded, "nothing was loaded"
    layer.quant_method.process_weights_after_loading(layer)
    x, w, ids = _routing(seed=1)
    out = _forward(layer, x, w, ids)
    ref = fused_moe_ref(x, packing.dequantize(q13), packing.dequantize(q2), w, ids)
    _assert_close(out, ref, fmt)


@pytest.mark.parametrize(
    "fmt, bits, gs, sym, v2, tp",
    [
        pytest.param("gptq", 4, 32, True, False, 2, id="gptq-gs32"),
        pytest.param("gptq", 4, 64, False, False, 2, id="gptq-gs64-asym-v1"),
        pytest.param("compressed-tensors", 4, -1, True, False, 2, id="ct-channelwise"),  # w2 scales whole per rank
        pytest.param("compressed-tensors", 8, 64, True, False, 2, id="ct-int8-gs64"),
        pytest.param("awq", 4, 32, False, False, 2, id="awq-gs32"),
        pytest.param("awq", 4, 128, False, False, 2, id="awq-gs128-regroup"),  # I/TP=64 < 128: re-grouped to 64
        # TP=4 at group 64: a rank holds half a group (re-grouped exactly to 32), ranks 0-1 and 2-3 on different
        # groups, so a rank reading another rank's scales or zero points fails (at TP=2, I == group: one group)
        pytest.param("gptq", 8, 64, False, True, 4, id="gptq-int8-gs64-asym-v2-tp4-regroup"),
        pytest.param("compressed-tensors", 4, 64, False, False, 4, id="ct-gs64-asym-tp4-regroup"),
        pytest.param("awq", 4, 64, False, False, 4, id="awq-gs64-tp4-regroup"),
    ],
)
def test_tp_rank_shards_sum_to_the_full_layer(vllm_cpu, monkeypatch, fmt, bits, gs, sym, v2, tp):
    q13, q2 = _random_experts(bits, gs, sym, seed=3 + bits + gs + tp)
    weights = _weights(fmt, q13, q2, v2)
    x, w, ids = _routing(seed=4)
    ref = fused_moe_ref(x, packing.dequantize(q13), packing.dequantize(q2), w, ids)
    partial = torch.zeros_like(ref, dtype=torch.float32)
    for rank in range(tp):
        monkeypatch.setattr(_vllm, "layer_tp", lambda layer, r=rank: (r, tp))
        layer = _build(vllm_cpu, RAW[fmt](bits, gs, sym, v2), tp_size=tp)
        assert layer.intermediate_size_per_partition == I // tp
        list(layer.load_weights(weights))
        layer.quant_method.process_weights_after_loading(layer)
        partial += _forward(layer, x, w, ids).float()
    _assert_close(partial, ref, f"{fmt} TP={tp} sum of ranks")


@pytest.mark.parametrize(
    "fmt, bits, gs, sym",
    [
        pytest.param("gptq", 4, 32, True, id="gptq-int4-gs32"),
        pytest.param("gptq", 8, 128, False, id="gptq-int8-gs128-asym"),
        pytest.param("awq", 4, 128, False, id="awq-int4-gs128"),
        pytest.param("compressed-tensors", 4, -1, True, id="ct-int4-channelwise"),
    ],
)
@pytest.mark.parametrize("ep", [2, pytest.param(3, id="3-uneven")])
@pytest.mark.parametrize("backend", ["reference", "triton"])  # triton: the interpreter on CPU
def test_ep_ranks_load_their_own_experts_and_sum_to_the_full_layer(vllm_cpu, monkeypatch, fmt, bits, gs, sym,
                                                                     backend, ep):  # fmt: skip
    """Expert parallelism as vLLM builds it (`--enable-expert-parallel`, TP=EP): each rank's layer holds whole
    experts (a linear range of E/EP, the first E % EP ranks one more) and vLLM's expert_map (-1 for the others'), its loader receives every expert of the checkpoint and keeps its
    own, and its forward adds only its experts' pairs. The ranks' outputs must sum to the full layer's (vLLM
    reduces them), and each rank alone must not equal it."""
    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", backend)
    q13, q2 = _random_experts(bits, gs, sym, seed=30 + bits)
    weights = _weights(fmt, q13, q2)
    x, w, ids = _routing(seed=31, m=8)
    ref = fused_moe_ref(x, packing.dequantize(q13), packing.dequantize(q2), w, ids)
    total = torch.zeros_like(ref, dtype=torch.float32)
    base, extra = divmod(E, ep)
    for rank in range(ep):
        simulate_ep_rank(monkeypatch, vllm_cpu, rank)
        layer = _build(vllm_cpu, RAW[fmt](bits, gs, sym), tp_size=ep)
        local = base + (rank < extra)
        first = rank * base + min(rank, extra)
        want = list(range(first, first + local))
        mine = [g for g in range(E) if _vllm.layer_local_expert_id(layer, g) >= 0]
        assert mine == want and layer.quant_method.num_local_experts == local, (mine, want)
        assert layer.expert_map is not None and layer.quant_method.selection.backend.name == backend
        assert _vllm.layer_global_experts(layer) == E and _vllm.layer_tp(layer) == (0, 1)  # whole experts
        list(layer.load_weights(weights))
        layer.quant_method.process_weights_after_loading(layer)  # every local expert loaded, or it names one
        part = _forward(layer, x, w, ids).float()
        own = torch.isin(ids, torch.tensor(mine))
        alone = fused_moe_ref(x, packing.dequantize(q13), packing.dequantize(q2), w * own, ids)
        _assert_close(part, alone, f"{fmt} EP rank {rank} of {ep}: its experts' pairs only")
        assert (part - ref.float()).abs().max() > ref.float().abs().max() * 2**-4, "one rank computed every expert"
        total += part
    _assert_close(total, ref, f"{fmt} EP={ep} sum of ranks")


def test_an_ep_rank_missing_one_of_its_experts_names_it_by_global_id(vllm_cpu, monkeypatch):
    simulate_ep_rank(monkeypatch, vllm_cpu, 1)
    q13, q2 = _random_experts(4, 32, True, seed=32)
    layer = _build(vllm_cpu, RAW["gptq"](4, 32, True), tp_size=2)
    mine = [g for g in range(E) if _vllm.layer_local_expert_id(layer, g) >= 0]
    drop = f"{mine[-1]}.down_proj.scales"
    list(layer.load_weights([(n, t) for n, t in _weights("gptq", q13, q2) if n != drop]))
    with pytest.raises(ValueError, match=rf"missing 1 tensor.*experts\.{mine[-1]}\.down_proj\.scales"):
        layer.quant_method.process_weights_after_loading(layer)


def test_missing_expert_tensor_is_named_at_load(vllm_cpu):
    q13, q2 = _random_experts(4, 32, True, seed=5)
    weights = [(n, t) for n, t in _weights("gptq", q13, q2) if n != "2.up_proj.scales"]
    layer = _build(vllm_cpu, RAW["gptq"](4, 32, True))
    list(layer.load_weights(weights))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*experts\.2\.up_proj\.scales"):
        layer.quant_method.process_weights_after_loading(layer)


def test_missing_tensor_is_named_by_its_global_expert_id(vllm_cpu, monkeypatch):
    # Expert placement as under EP, where local and global ids differ: global g lives at local (g + 1) % E.
    monkeypatch.setattr(_vllm, "layer_local_expert_id", lambda layer, g: (g + 1) % E)
    q13, q2 = _random_experts(4, 32, True, seed=8)
    weights = [(n, t) for n, t in _weights("gptq", q13, q2) if n != "2.down_proj.qweight"]
    layer = _build(vllm_cpu, RAW["gptq"](4, 32, True))
    list(layer.load_weights(weights))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*: model\.layers\.0\.mlp\.experts\.2\.down_proj\.qweight "):
        layer.quant_method.process_weights_after_loading(layer)


def test_misshaped_tensor_is_a_clear_error(vllm_cpu):
    q13, q2 = _random_experts(4, 32, True, seed=6)
    weights = _weights("gptq", q13, q2)
    weights = [(n, t[:-8] if n == "1.down_proj.qweight" else t) for n, t in weights]
    layer = _build(vllm_cpu, RAW["gptq"](4, 32, True))
    expected = (
        r"experts\.1\.down_proj\.qweight \(expert 1 of model\.layers\.0\.mlp\.experts\): expected shape \(16, 128\)"
    )
    with pytest.raises(ValueError, match=expected):
        list(layer.load_weights(weights))


def test_explicit_backend_that_cannot_work_fails_at_create_weights(vllm_cpu, monkeypatch):
    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "marlin")
    with pytest.raises(ValueError, match=r"backend 'marlin'.*needs an NVIDIA GPU.*would work: \[.*reference"):
        _build(vllm_cpu, RAW["gptq"](4, 32, True))


# Layers whose experts compute more than act(gate) * up (vLLM builds them for gpt-oss, EXAONE-MoE, Bailing-V3, Kimi):
# refused while the layer is built, naming the field and its value, never run as plain SwiGLU.
EXPERT_MATH = [
    pytest.param({"activation": "swigluoai"}, r"activation is 'swigluoai'", id="swigluoai"),
    pytest.param({"activation": "gelu_tanh"}, r"activation is 'gelu_tanh'", id="gelu-tanh"),
    pytest.param({"has_bias": True}, r"bias on each expert.*has_bias=True", id="bias"),
    pytest.param({"swiglu_limit": 7.0}, r"clamp on the gated activation \(swiglu_limit=7\.0\)", id="clamp"),
    pytest.param({"swiglu_alpha": 1.702, "swiglu_limit": 7.0}, r"swiglu_limit=7\.0.*swiglu_alpha=1\.702", id="oai"),
    pytest.param({"activation_situ_beta": 1.0}, r"SituGLU.*activation_situ_beta=1\.0", id="situ"),
]


@pytest.mark.parametrize("kwargs, match", EXPERT_MATH)
def test_experts_with_math_the_kernels_do_not_compute_are_refused(vllm_cpu, kwargs, match):
    import inspect

    from vllm.model_executor.layers.quantization import get_quantization_config

    cls = _vllm.fused_moe_layer_cls()
    params = inspect.signature(cls).parameters
    missing = [k for k in kwargs if k not in params]
    if missing:
        pytest.skip(f"this vLLM's MoE layer has no {missing}")
    qc = get_quantization_config("moe_wna16_plus").from_config(RAW["gptq"](4, 32, True))
    prefix = "model.layers.7.mlp.experts"
    vllm_cpu.compilation_config.static_forward_context.pop(prefix, None)
    build = dict(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
                 quant_config=qc, tp_size=1, prefix=prefix)  # fmt: skip
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.experts: .*" + match + r".*vLLM's own"):
        cls(**build, **kwargs)
    vllm_cpu.compilation_config.static_forward_context.pop(prefix, None)
    cls(**build)  # the same layer with plain experts builds


def test_group_size_that_cannot_split_is_named(vllm_cpu, monkeypatch):
    # I=128 at TP=16 gives K=8 per rank: no exact re-grouping of gs128 exists.
    monkeypatch.setattr(_vllm, "layer_tp", lambda layer: (0, 16))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts.*down"):
        _build(vllm_cpu, RAW["gptq"](4, 128, True), tp_size=16)


@pytest.mark.parametrize("GS", [32, 128], ids=["gs32", "gs128-regrouped"])
@pytest.mark.parametrize("rank", [0, 1])
def test_trivial_act_order_g_idx_under_tp_reads_only_this_ranks_groups(vllm_cpu, monkeypatch, rank, GS):  # noqa: N803
    """desc_act keeps every group of the down projection on each rank (its g_idx names global groups). A
    trivial g_idx (GPTQ static_groups) is dropped at load, and the rank must then read its own groups only:
    before the fix rank 1 read rank 0's (relative error 0.7 instead of 0.009). With group 128, I per rank
    (64) holds half a group: the rank's groups are re-grouped to 64 (formerly refused at create_weights)."""
    E, H, I, TOP_K, TP = 4, 128, 128, 2, 2  # noqa: N806, E741
    monkeypatch.setattr(_vllm, "layer_tp", lambda layer: (rank, TP))
    gen = torch.Generator().manual_seed(20 + rank)

    def experts(n, k):
        w = torch.randn(E, n, k, generator=gen) * 0.05
        qws = [packing.quantize_rtn(w[e], 4, GS, has_zero_point=True) for e in range(E)]
        for qw in qws:
            qw.scales = qw.scales.half().float()
        return torch.stack([packing.dequantize(qw) for qw in qws]), qws

    (wg, qg), (wu, qu), (wd, qd) = experts(I, H), experts(I, H), experts(H, I)
    weights = []
    for e in range(E):
        for proj, qw, k in (("gate_proj", qg[e], H), ("up_proj", qu[e], H), ("down_proj", qd[e], I)):
            for key, t in packing.pack_gptq(qw, zero_point_offset=0).items():
                weights.append((f"{e}.{proj}.{key}", t.half() if key == "scales" else t))
            weights.append((f"{e}.{proj}.g_idx", (torch.arange(k) // GS).to(torch.int32)))  # trivial
    raw = {"quant_method": "gptq", "bits": 4, "group_size": GS, "sym": False, "desc_act": True,
           "checkpoint_format": "gptq_v2"}  # fmt: skip
    layer = build_moe_layer(vllm_cpu, raw, E=E, H=H, I=I, top_k=TOP_K, tp_size=TP)
    assert layer.quant_method.problem.act_order_issue is None  # act order at TP runs padded (triton)
    list(layer.load_weights(weights))
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.quant_method.problem.has_g_idx
    assert layer.quant_method.tensors.w2_scales.shape[-1] == I // TP // min(GS, I // TP)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    w = torch.rand(6, TOP_K, generator=gen)
    out = layer.quant_method.apply(layer, x, w, ids, None, None).float()
    own = slice(rank * I // TP, (rank + 1) * I // TP)
    exact = fused_moe_ref(x, torch.cat([wg[:, own], wu[:, own]], 1), wd[:, :, own], w, ids).float()
    assert (out - exact).abs().max() / exact.abs().max() < 2**-6


class _FakeHumming:
    """Humming's place in the registry on CPU: prepare fails when told to; run marks its output with 7."""

    name, sorted_act_order, description = "humming", False, "fake"

    def __init__(self, fail: bool):
        self.fail, self.prepared = fail, 0

    def incompatibility_reason(self, problem):
        return None

    def prepare(self, problem, tensors):
        if self.fail:
            raise RuntimeError("nvrtc: compile failed")
        self.prepared += 1
        return "state"

    def prepared_problem(self, problem, state):
        return problem

    def run(self, problem, state, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        return torch.full((x.shape[0], problem.hidden), 7.0, dtype=x.dtype)


def _load_composed_and_run(vllm_cpu, monkeypatch, caplog, seed: int):
    """Load a random GPTQ layer on CPU with memory for any copy (the tests below patch what composes), process it,
    check M=2 against the reference and run M=6. (layer, M=6's output, M=6's reference, the log's text)."""
    import logging

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 139 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2**30)
    q13, q2 = _random_experts(4, 32, True, seed=seed)
    layer = _build(vllm_cpu, RAW["gptq"](4, 32, True))
    list(layer.load_weights(_weights("gptq", q13, q2)))
    # vLLM's logger, as a test before this one may have left it (the CLI tests set it to ERROR; vLLM's own
    # configuration stops it propagating to the root, where caplog listens)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    dense13, dense2 = packing.dequantize(q13), packing.dequantize(q2)
    with caplog.at_level(logging.INFO, logger="vllm"):
        layer.quant_method.process_weights_after_loading(layer)
        small, large = _routing(seed=2, m=2), _routing(seed=3, m=6)
        _assert_close(_forward(layer, *small), fused_moe_ref(small[0], dense13, dense2, *small[1:]),
                      "M=2 on the plugin's kernels")  # fmt: skip
        out = _forward(layer, *large)
    return layer, out, fused_moe_ref(large[0], dense13, dense2, *large[1:]), caplog.text


@pytest.mark.parametrize("partner", ["humming", "marlin"])
@pytest.mark.parametrize("fail", [False, True])
def test_a_composed_layer_hands_large_batches_to_its_partner_or_falls_back(vllm_cpu, monkeypatch, caplog, fail,
                                                                          partner):  # fmt: skip
    """The load-time wiring of auto + a vLLM kernel (compose.py; moe_method._compose, _build_runner) on CPU: the
    layer's own backend stands in for the plugin's kernels, a fake for Humming or Marlin, which the rule gives
    M >= 4. Memory allows the copy; a partner that cannot be prepared leaves the plugin's kernels at every M,
    with a warning."""
    import dataclasses

    from vllm_wna16_plugin import compose, launch_plan
    from vllm_wna16_plugin.backends import registry

    fake = _FakeHumming(fail)
    chosen = dataclasses.replace(compose.partner_named(partner), takes=lambda problem, m, device: m >= 4)
    monkeypatch.setattr(compose, "partners", lambda: (chosen,))
    monkeypatch.setattr(compose, "composable_with", lambda selection, name: None)
    monkeypatch.setattr(launch_plan, "registry", lambda: {**registry(), partner: fake})
    monkeypatch.setattr(launch_plan, "COMPOSABLE", (*launch_plan.COMPOSABLE, "reference"))
    layer, out, ref, text = _load_composed_and_run(vllm_cpu, monkeypatch, caplog, seed=17)
    if fail:
        assert f"{chosen.label} could not be prepared (RuntimeError: nvrtc: compile failed)" in text
        _assert_close(out, ref, "M=6 after the fallback")
        assert layer.quant_method.problem.options.compose_with is None
    else:
        assert f"second copy of its experts in {chosen.label}'s layout" in text and fake.prepared == 1
        assert chosen.env in text
        assert bool((out == 7).all()), f"M=6 did not run on {chosen.label}"
        assert layer.quant_method.runner.plan(6).backend == partner


@pytest.mark.parametrize("setting", ["auto", "0", "fail"])
def test_a_layer_with_the_hopper_copy_hands_it_its_batches_or_falls_back(vllm_cpu, monkeypatch, caplog, setting):
    """The load-time wiring of auto + the plugin's hopper kernel (compose.hopper_composable / with_hopper;
    moe_method._compose, _build_runner) on CPU: the layer's own backend stands in for the plugin's other kernels, a
    fake for the hopper kernel, whose rule is made to take M >= 4. VLLM_WNA16_PLUS_HOPPER=0 leaves the copy out; a
    hopper copy that cannot be prepared leaves the plugin's other kernels at every M, with a warning."""

    from vllm_wna16_plugin import compose, launch_plan
    from vllm_wna16_plugin.backends import hopper, registry

    fake = _FakeHumming(setting == "fail")
    fake.name = "hopper"
    monkeypatch.setattr(compose, "partners", lambda: ())
    monkeypatch.setattr(compose, "hopper_composable", lambda selection, max_tokens=None: None)
    monkeypatch.setattr(hopper, "hopper_takes", lambda problem, m, device: m >= 4)
    monkeypatch.setattr(launch_plan, "registry", lambda: {**registry(), "hopper": fake})
    monkeypatch.setattr(launch_plan, "COMPOSABLE", (*launch_plan.COMPOSABLE, "reference"))
    if setting == "0":
        monkeypatch.setenv(hopper.ENV_COMPOSE, "0")
    layer, out, ref, text = _load_composed_and_run(vllm_cpu, monkeypatch, caplog, seed=19)
    options = layer.quant_method.problem.options
    if setting == "auto":
        assert "another copy of its experts in the hopper kernel's layout" in text and fake.prepared == 1
        assert hopper.ENV_COMPOSE in text and options.hopper
        assert bool((out == 7).all()), "M=6 did not run on the hopper kernel"
        assert layer.quant_method.runner.plan(6).backend == "hopper"
    elif setting == "0":
        assert "not composed with the hopper kernel (VLLM_WNA16_PLUS_HOPPER=0)" in text and fake.prepared == 0
        assert not options.hopper and layer.quant_method.runner.plan(6).backend != "hopper"
        _assert_close(out, ref, "M=6 without the hopper copy")
    else:
        assert "the hopper kernel could not be prepared (RuntimeError: nvrtc: compile failed)" in text
        assert not options.hopper
        _assert_close(out, ref, "M=6 after the fallback")


def test_a_hopper_copy_that_cannot_be_prepared_leaves_the_partners(vllm_cpu, monkeypatch, caplog):
    """Both copies composed (Marlin's and the hopper kernel's); the hopper copy fails to prepare: the layer keeps
    Marlin's for the batches its rule takes, with a warning naming the hopper kernel."""
    import dataclasses

    from vllm_wna16_plugin import compose, launch_plan
    from vllm_wna16_plugin.backends import hopper, registry

    partner, broken = _FakeHumming(False), _FakeHumming(True)
    chosen = dataclasses.replace(compose.partner_named("marlin"), takes=lambda problem, m, device: m >= 4)
    monkeypatch.setattr(compose, "partners", lambda: (chosen,))
    monkeypatch.setattr(compose, "composable_with", lambda selection, name: None)
    monkeypatch.setattr(compose, "hopper_composable", lambda selection, max_tokens=None: None)
    monkeypatch.setattr(hopper, "hopper_takes", lambda problem, m, device: m >= 4)
    monkeypatch.setattr(launch_plan, "registry", lambda: {**registry(), "marlin": partner, "hopper": broken})
    monkeypatch.setattr(launch_plan, "COMPOSABLE", (*launch_plan.COMPOSABLE, "reference"))
    layer, out, _, text = _load_composed_and_run(vllm_cpu, monkeypatch, caplog, seed=23)
    assert "the hopper kernel could not be prepared (RuntimeError: nvrtc: compile failed)" in text
    assert "runs its other copy" in text and partner.prepared >= 1
    options = layer.quant_method.problem.options
    assert options.compose_with == "marlin" and not options.hopper
    assert bool((out == 7).all()) and layer.quant_method.runner.plan(6).backend == "marlin"


@pytest.mark.interpreter
def test_processing_an_act_order_layer_again_without_a_load_keeps_it_right(vllm_cpu, monkeypatch):
    """process_weights_after_loading leaves an act-order layer's parameters sorted by g_idx (which keeps the
    checkpoint's order). Called a second time with nothing loaded in between, it sorted the sorted weights again:
    a silently wrong layer (max error 0.36 here, tolerance 0.003). It is a no-op now; a load in between reprocesses."""
    from tests.kernels import test_act_order as act

    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "triton")  # sorts act order at load (the interpreter on CPU)
    gen = torch.Generator().manual_seed(31)
    w13, w2, weights = act._gptq_checkpoint(gen)
    layer = build_moe_layer(vllm_cpu, act.RAW_GPTQ_ACT, E=act.E, H=act.H, I=act.I, top_k=act.TOP_K)
    method = layer.quant_method
    list(layer.load_weights(weights))
    method.process_weights_after_loading(layer)
    assert method.runner.states["triton"].a_perm is not None  # the parameters now hold the sorted layout
    method.process_weights_after_loading(layer)
    x = torch.randn(5, act.H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(act.E, generator=gen)[: act.TOP_K] for _ in range(5)])
    w = torch.rand(5, act.TOP_K, generator=gen)
    _assert_close(_forward(layer, x, w, ids), fused_moe_ref(x, w13, w2, w, ids), "processed twice")
    # a full load after processing brings back the checkpoint layout, which is processed again
    w13b, w2b, weights_b = act._gptq_checkpoint(gen)
    list(layer.load_weights(weights_b))
    method.process_weights_after_loading(layer)
    _assert_close(_forward(layer, x, w, ids), fused_moe_ref(x, w13b, w2b, w, ids), "loaded again, processed")


class _Model(torch.nn.Module):
    """The smallest model vLLM's reload lifecycle drives: one MoE layer and its load_weights."""

    def __init__(self, layer):
        super().__init__()
        self.experts = layer

    def load_weights(self, weights):
        return set(self.experts.load_weights(weights))


def _runner_tensors(runner):
    from vllm_wna16_plugin.launch_plan import _tensor_leaves

    return [t for _, t in _tensor_leaves((runner.tensors, runner.states))]


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_vllm_reload_weights_refreshes_the_kernels_tensors_in_place(vllm_cpu, monkeypatch, backend):
    """vLLM's reload_weights (layerwise: initialize, load_weights, finalize) processes the layer on
    temporary parameters and copies them into the layer's own. The runner kept the temporary ones: a second copy
    of the experts per layer, and CUDA graphs captured before the reload read the old sorted / repacked tensors.
    Now the reloaded weights go into the runner's own tensors: same runner, same storage, the new numbers."""
    from vllm.model_executor.model_loader.reload.layerwise import (  # reload_weights' steps, vLLM 0.26-0.34
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    from tests.kernels import test_act_order as act

    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", backend)  # triton sorts act order at load
    gen = torch.Generator().manual_seed(37)
    w13, w2, weights = act._gptq_checkpoint(gen)
    layer = build_moe_layer(vllm_cpu, act.RAW_GPTQ_ACT, E=act.E, H=act.H, I=act.I, top_k=act.TOP_K)
    model = _Model(layer)
    record_metadata_for_reloading(model)
    model.load_weights(weights)
    method = layer.quant_method
    method.process_weights_after_loading(layer)
    runner = method.runner
    before = [(t.data_ptr(), t.shape) for t in _runner_tensors(runner)]
    x = torch.randn(5, act.H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(act.E, generator=gen)[: act.TOP_K] for _ in range(5)])
    w = torch.rand(5, act.TOP_K, generator=gen)
    _assert_close(_forward(layer, x, w, ids), fused_moe_ref(x, w13, w2, w, ids), "loaded")
    w13b, w2b, weights_b = act._gptq_checkpoint(gen)  # another act order too: the sorted layout changes
    initialize_layerwise_reload(model)
    model.load_weights(weights_b)
    finalize_layerwise_reload(model, vllm_cpu.model_config)
    assert layer.quant_method.runner is runner
    assert [(t.data_ptr(), t.shape) for t in _runner_tensors(runner)] == before
    _assert_close(_forward(layer, x, w, ids), fused_moe_ref(x, w13b, w2b, w, ids), "reloaded")
