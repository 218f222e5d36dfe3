"""Tiny on-disk checkpoints: config blocks, tokenizer, tensor names/dtypes/shapes, and exact
round trips disk -> packing.unpack_* -> dequantize == reference/, for every format."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_wna16_plugin import packing
from vllm_wna16_plugin.tools import make_checkpoint as mc

# hidden = intermediate = 128 is the smallest size that every group size here (32, 128,
# channel-wise) divides; 2 layers so layer indexing is exercised, 4 experts, top-2.
TINY = dict(hidden=128, intermediate=128, experts=4, top_k=2, layers=2)
GPTQ_GS = (32, 128, -1)


def _case(fmt, bits, gs, sym, **extra):
    tag = "ch" if gs == -1 else f"g{gs}"
    more = "".join(f"-{k}={v}" for k, v in extra.items())
    return pytest.param(
        dict(fmt=fmt, bits=bits, group_size=gs, sym=sym, **extra),
        id=f"{fmt}-int{bits}-{tag}-{'sym' if sym else 'asym'}{more}",
    )


CASES = (
    [_case("gptq", b, g, s) for b in (4, 8) for g in GPTQ_GS for s in (True, False)]
    + [_case("awq", 4, g, s) for g in GPTQ_GS for s in (True, False)]  # AWQ GEMM is 4-bit only
    + [_case("compressed-tensors", b, g, s) for b in (4, 8) for g in GPTQ_GS for s in (True, False)]
    + [
        _case("gptq", 4, 32, True, desc_act=True),  # act order: random g_idx
        _case("gptq", 8, 32, False, desc_act=True),
        _case("compressed-tensors", 4, 64, False, desc_act=True),  # actorder: group, weight_g_idx
        _case("compressed-tensors", 8, 32, True, desc_act=True),
        _case("gptq", 4, 32, False, checkpoint_format="gptq_v2"),  # zero points not offset by 1
        _case("gptq", 4, 128, True, checkpoint_format="gptq_v2"),
        _case("compressed-tensors", 4, -1, False, group_size_null=True),  # "group_size": null
        _case("compressed-tensors", 8, -1, True, group_size_null=True),
        _case("gptq", 4, 32, False, arch="mixtral"),
        _case("awq", 4, 32, False, arch="mixtral"),
        _case("compressed-tensors", 4, 32, False, arch="mixtral"),
        _case("gptq", 4, 128, True, quantize_attention=False),
        _case("awq", 4, 128, False, quantize_attention=False),
        _case("compressed-tensors", 8, 32, True, quantize_attention=False),
    ]
)


@pytest.fixture(scope="module", params=CASES)
def ckpt(request, tmp_path_factory):
    """(checkpoint dir, CheckpointSpec) built once per case and shared by the tests below."""
    kwargs = {**TINY, **request.param}
    out = mc.make_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=1234, **kwargs)
    return out, mc.CheckpointSpec(**kwargs, seed=1234)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _arch_names(spec):
    if spec.arch == "qwen3_moe":
        return "mlp", ("gate_proj", "up_proj", "down_proj")
    return "block_sparse_moe", ("w1", "w3", "w2")


def _quantized_entries(spec, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Expected {suffix: (dtype, shape)} of one quantized (N, K) linear, written out by hand."""
    pf = 32 // spec.bits
    g = 1 if spec.group_size == -1 else k // spec.group_size
    if spec.fmt == "gptq":
        return {
            "qweight": (torch.int32, (k // pf, n)),
            "qzeros": (torch.int32, (g, n // pf)),
            "scales": (torch.float16, (g, n)),
            "g_idx": (torch.int32, (k,)),
        }
    if spec.fmt == "awq":
        return {
            "qweight": (torch.int32, (k, n // 8)),
            "qzeros": (torch.int32, (g, n // 8)),
            "scales": (torch.float16, (g, n)),
        }
    out = {
        "weight_packed": (torch.int32, (n, k // pf)),
        "weight_scale": (torch.bfloat16, (n, g)),
        "weight_shape": (torch.int64, (2,)),
    }
    if not spec.sym:
        out["weight_zero_point"] = (torch.int32, (n // pf, g))
    if spec.desc_act:  # actorder: group
        out["weight_g_idx"] = (torch.int32, (k,))
    return out


def _expected_tensors(spec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    h, i, v = spec.hidden, spec.intermediate, spec.resolved_vocab_size
    hd = 64
    heads, kv = h // hd, max(1, h // hd // 2)
    moe, (gate, up, down) = _arch_names(spec)
    bf16 = torch.bfloat16
    out = {
        "model.embed_tokens.weight": (bf16, (v, h)),
        "model.norm.weight": (bf16, (h,)),
        "lm_head.weight": (bf16, (v, h)),
    }

    def linear(prefix, n, k, quantized):
        if quantized:
            for suffix, entry in _quantized_entries(spec, n, k).items():
                out[f"{prefix}.{suffix}"] = entry
        else:
            out[f"{prefix}.weight"] = (bf16, (n, k))

    for li in range(spec.layers):
        p = f"model.layers.{li}"
        linear(f"{p}.self_attn.q_proj", heads * hd, h, spec.quantize_attention)
        linear(f"{p}.self_attn.k_proj", kv * hd, h, spec.quantize_attention)
        linear(f"{p}.self_attn.v_proj", kv * hd, h, spec.quantize_attention)
        linear(f"{p}.self_attn.o_proj", h, heads * hd, spec.quantize_attention)
        if spec.arch == "qwen3_moe":
            out[f"{p}.self_attn.q_norm.weight"] = (bf16, (hd,))
            out[f"{p}.self_attn.k_norm.weight"] = (bf16, (hd,))
        out[f"{p}.input_layernorm.weight"] = (bf16, (h,))
        out[f"{p}.post_attention_layernorm.weight"] = (bf16, (h,))
        out[f"{p}.{moe}.gate.weight"] = (bf16, (spec.experts, h))
        for e in range(spec.experts):
            linear(f"{p}.{moe}.experts.{e}.{gate}", i, h, True)
            linear(f"{p}.{moe}.experts.{e}.{up}", i, h, True)
            linear(f"{p}.{moe}.experts.{e}.{down}", h, i, True)
    return out


def _unpack(spec, t: dict[str, torch.Tensor], prefix: str) -> tuple[packing.QuantizedWeight, torch.Tensor]:
    """(QuantizedWeight, g_idx (K,)) of one stored linear, through packing.py's readers."""
    has_zp = not spec.sym
    if spec.fmt == "gptq":
        qw = packing.unpack_gptq(
            t[f"{prefix}.qweight"],
            t[f"{prefix}.qzeros"],
            t[f"{prefix}.scales"],
            spec.bits,
            zero_point_offset=1 if spec.checkpoint_format == "gptq" else 0,
            has_zero_point=has_zp,
        )
        return qw, t[f"{prefix}.g_idx"].long()
    if spec.fmt == "awq":
        qw = packing.unpack_awq(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"], spec.bits, has_zp)
    else:
        assert t[f"{prefix}.weight_shape"].tolist() == list(t[f"{prefix}.weight_scale"].shape[:1]) + [
            t[f"{prefix}.weight_packed"].shape[1] * 32 // spec.bits
        ]
        qw = packing.unpack_compressed_tensors(
            t[f"{prefix}.weight_packed"],
            t[f"{prefix}.weight_scale"],
            t.get(f"{prefix}.weight_zero_point"),
            spec.bits,
            has_zp,
        )
    k = qw.q.shape[-1]
    if f"{prefix}.weight_g_idx" in t:  # compressed-tensors actorder: group
        return qw, t[f"{prefix}.weight_g_idx"].long()
    return qw, torch.arange(k) // qw.group_size


def _dequant_g_idx(qw: packing.QuantizedWeight, g_idx: torch.Tensor) -> torch.Tensor:
    """(q - zero[g_idx]) * scale[g_idx] in float32: a gather, independent of packing.dequantize."""
    zeros = qw.zeros_or_midpoint()[:, g_idx].float()
    scales = qw.scales[:, g_idx].float()
    return (qw.q.float() - zeros) * scales


def _experts(spec, t, layer):
    """Dequantized (w13 (E, 2I, H), w2 (E, H, I)) and the unpacked weights, from disk."""
    moe, (gate, up, down) = _arch_names(spec)
    w13, w2, unpacked = [], [], []
    for e in range(spec.experts):
        p = f"model.layers.{layer}.{moe}.experts.{e}"
        parts = [_unpack(spec, t, f"{p}.{name}") for name in (gate, up, down)]
        unpacked += parts
        g_w, u_w, d_w = (_dequant_g_idx(qw, g_idx) for qw, g_idx in parts)
        w13.append(torch.cat([g_w, u_w]))
        w2.append(d_w)
    return torch.stack(w13), torch.stack(w2), unpacked


# ---------------------------------------------------------------- config.json


def test_config_block_is_the_formats_own(ckpt):
    path, spec = ckpt
    config = json.loads((path / "config.json").read_text())
    q = config["quantization_config"]
    router = "mlp.gate" if spec.arch == "qwen3_moe" else "block_sparse_moe.gate"
    if spec.fmt == "gptq":
        assert {
            k: q[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "lm_head")
        } == {
            "quant_method": "gptq",
            "bits": spec.bits,
            "group_size": spec.group_size,
            "sym": spec.sym,
            "desc_act": spec.desc_act,
            "checkpoint_format": spec.checkpoint_format,
            "lm_head": False,
        }
        assert q.get("dynamic") == (None if spec.quantize_attention else {"-:.*self_attn.*": {}})
    elif spec.fmt == "awq":
        assert {k: q[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group_size,
            "zero_point": not spec.sym,
            "version": "gemm",
        }
        assert q["modules_to_not_convert"] == [router] + ([] if spec.quantize_attention else ["self_attn"])
    else:
        assert q["quant_method"] == "compressed-tensors"
        assert q["format"] == "pack-quantized"
        assert q["quantization_status"] == "compressed"
        assert list(q["config_groups"]) == ["group_0"]
        group = q["config_groups"]["group_0"]
        assert group["targets"] == ["Linear"]
        assert group["input_activations"] is None
        w = group["weights"]
        assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (spec.bits, "int", spec.sym, False)
        if spec.group_size == -1:
            assert (w["strategy"], w["group_size"]) == ("channel", None if spec.group_size_null else -1)
        else:
            assert (w["strategy"], w["group_size"]) == ("group", spec.group_size)
        assert q["ignore"] == ["lm_head", f"re:.*{router}$"] + ([] if spec.quantize_attention else ["re:.*self_attn.*"])
        # the library itself accepts the block it wrote
        from compressed_tensors.quantization import QuantizationConfig

        QuantizationConfig.model_validate({k: v for k, v in q.items() if k in QuantizationConfig.model_fields})


def test_autoconfig_loads_offline(ckpt):
    from transformers import AutoConfig

    path, spec = ckpt
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    assert cfg.model_type == spec.arch
    assert cfg.architectures == [{"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[spec.arch]]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts_per_tok) == (spec.hidden, spec.layers, spec.top_k)
    assert cfg.num_attention_heads * cfg.head_dim == spec.hidden
    assert cfg.vocab_size == spec.resolved_vocab_size and cfg.vocab_size % 64 == 0
    assert cfg.tie_word_embeddings is False
    assert cfg.dtype == torch.bfloat16
    if spec.arch == "qwen3_moe":
        assert (cfg.num_experts, cfg.moe_intermediate_size) == (spec.experts, spec.intermediate)
        assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == [] and cfg.norm_topk_prob is True
    else:
        assert (cfg.num_local_experts, cfg.intermediate_size) == (spec.experts, spec.intermediate)
    assert cfg.quantization_config["quant_method"] == spec.fmt


# ---------------------------------------------------------------- safetensors


def test_safetensors_hold_exactly_the_expected_tensors(ckpt):
    path, spec = ckpt
    got = {k: (v.dtype, tuple(v.shape)) for k, v in _tensors(path).items()}
    want = _expected_tensors(spec)
    assert sorted(set(got) - set(want)) == [], "unexpected tensors"
    assert sorted(set(want) - set(got)) == [], "missing tensors"
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert bad == {}


def test_reference_is_outside_vllms_weight_glob(ckpt):
    path, spec = ckpt
    # vLLM's default loader globs <dir>/*.safetensors only (not recursive)
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    ref = mc.load_reference(path)
    e, h, i = spec.experts, spec.hidden, spec.intermediate
    for li in range(spec.layers):
        for name, shape in (("w13", (e, 2 * i, h)), ("w2", (e, h, i))):
            for suffix in ("", "_float"):
                t = ref[f"layers.{li}.{name}{suffix}"]
                assert t.dtype == torch.float32 and tuple(t.shape) == shape
    assert len(ref) == 4 * spec.layers
    assert mc.load_spec(path) == spec


def test_unpacked_disk_tensors_reproduce_reference_exactly(ckpt):
    path, spec = ckpt
    t = _tensors(path)
    ref = mc.load_reference(path)
    for li in range(spec.layers):
        w13, w2, _ = _experts(spec, t, li)
        assert torch.equal(w13, ref[f"layers.{li}.w13"]), f"layer {li} w13"
        assert torch.equal(w2, ref[f"layers.{li}.w2"]), f"layer {li} w2"


def test_dequantized_within_half_a_step_of_the_floats(ckpt):
    """RTN error is at most half a quantization step per element (plus the scale's storage rounding)."""
    path, spec = ckpt
    t = _tensors(path)
    ref = mc.load_reference(path)
    unit = 2.0**-8 if spec.fmt == "compressed-tensors" else 2.0**-11  # bf16 / fp16 scale rounding
    rel_rms_bound = 0.15 if spec.bits == 4 else 0.02
    for li in range(spec.layers):
        w13, w2, unpacked = _experts(spec, t, li)
        floats = torch.cat([ref[f"layers.{li}.w13_float"].flatten(), ref[f"layers.{li}.w2_float"].flatten()])
        deq = torch.cat([w13.flatten(), w2.flatten()])
        steps, ints = [], []
        for e in range(spec.experts):
            g, u, d = unpacked[3 * e : 3 * e + 3]
            for qw, g_idx in (g, u):
                steps.append(qw.scales[:, g_idx].float().flatten())
                ints.append((qw.q - qw.zeros_or_midpoint()[:, g_idx]).abs().float().flatten())
        for e in range(spec.experts):
            qw, g_idx = unpacked[3 * e + 2]
            steps.append(qw.scales[:, g_idx].float().flatten())
            ints.append((qw.q - qw.zeros_or_midpoint()[:, g_idx]).abs().float().flatten())
        step, qint = torch.cat(steps), torch.cat(ints)
        err = (deq - floats).abs()
        bound = step * (0.5 + qint * unit) * (1 + 2 * unit)  # step is the rounded scale
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
        rel_rms = (err.square().mean().sqrt() / floats.square().mean().sqrt()).item()
        assert 0 < rel_rms < rel_rms_bound, f"relative RMS error {rel_rms:.4f}"


def test_gptq_and_awq_symmetric_zero_words_are_the_midpoint(ckpt):
    """Known answer, independent of packing.py: every 4-bit word packs 8 equal nibbles."""
    path, spec = ckpt
    if spec.fmt == "compressed-tensors" or not spec.sym:
        pytest.skip("symmetric GPTQ/AWQ only (compressed-tensors stores no zero points when symmetric)")
    mid = 1 << (spec.bits - 1)
    nibble = mid - 1 if (spec.fmt == "gptq" and spec.checkpoint_format == "gptq") else mid  # v1 stores zero-1
    word = sum(nibble << (spec.bits * s) for s in range(32 // spec.bits))
    word = word - 2**32 if word >= 2**31 else word
    for name, tensor in _tensors(path).items():
        if name.endswith(".qzeros"):
            assert bool((tensor == word).all()), name


def test_compressed_tensors_library_decompresses_to_the_reference(ckpt):
    """The library's own decompressor, driven by the config.json block, reads our files as we do."""
    path, spec = ckpt
    if spec.fmt != "compressed-tensors":
        pytest.skip("compressed-tensors only")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    block = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(block["config_groups"]["group_0"])
    t = _tensors(path)
    ref = mc.load_reference(path)
    moe, (gate, up, down) = _arch_names(spec)
    i = spec.intermediate
    for e in (0, spec.experts - 1):
        for name, want in (
            (gate, ref["layers.1.w13"][e, :i]),
            (up, ref["layers.1.w13"][e, i:]),
            (down, ref["layers.1.w2"][e]),
        ):
            p = f"model.layers.1.{moe}.experts.{e}.{name}"
            state = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(p + ".")}
            got = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
            # the library computes (q - zero) * scale in bf16; our float32 product is exact
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, want.to(torch.bfloat16)), p


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(arch="qwen3_moe", bits=4, group_size=32), id="qwen3-int4-g32"),
        pytest.param(
            dict(arch="mixtral", bits=8, group_size=-1, quantize_attention=False), id="mixtral-int8-ch-noattn"
        ),
    ],
)
def test_transformers_loads_symmetric_compressed_tensors_and_runs(tmp_path, kwargs):
    """transformers (through compressed-tensors) decompresses our experts to the reference, and a
    forward pass is finite. Symmetric only: transformers 5.24's MoE dequantize drops weight_zero_point."""
    from transformers import AutoModelForCausalLM

    path = mc.make_checkpoint(tmp_path, fmt="compressed-tensors", sym=True, **{**TINY, **kwargs})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True)
    state = model.state_dict()
    ref = mc.load_reference(path)
    for li in range(TINY["layers"]):
        # transformers names both architectures' fused experts mlp.experts.{gate_up_proj,down_proj}
        assert torch.equal(
            state[f"model.layers.{li}.mlp.experts.gate_up_proj"], ref[f"layers.{li}.w13"].to(torch.bfloat16)
        )
        assert torch.equal(state[f"model.layers.{li}.mlp.experts.down_proj"], ref[f"layers.{li}.w2"].to(torch.bfloat16))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 40, 41, 42, 43, 44]])).logits
    assert logits.shape == (1, 6, mc.CheckpointSpec(fmt="gptq").resolved_vocab_size)
    assert bool(logits.isfinite().all()) and logits.float().std() > 0


# ---------------------------------------------------------------- packing.py vs the library


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("group_size", (32, -1), ids=("g32", "ch"))
@pytest.mark.parametrize("sym", (True, False), ids=("sym", "asym"))
def test_packing_matches_compressed_tensors_library(bits, group_size, sym):
    """The library's compressor output == packing.pack_compressed_tensors, and unpacks to our ints."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 96, generator=gen) * 0.02
    spec = mc.CheckpointSpec(
        fmt="compressed-tensors", bits=bits, group_size=group_size, sym=sym, hidden=96, intermediate=96
    )
    qw = packing.quantize_rtn(w, bits, group_size, has_zero_point=not sym)
    qw = packing.QuantizedWeight(qw.q, qw.scales.to(torch.bfloat16), qw.zeros, bits, qw.group_size)
    lib = mc.compress_with_library(qw, packing.dequantize(qw), spec)
    ours = packing.pack_compressed_tensors(qw)
    assert sorted(lib) == sorted(ours)
    for name in ours:
        assert lib[name].dtype == ours[name].dtype, name
        assert torch.equal(lib[name], ours[name]), name
    back = packing.unpack_compressed_tensors(
        lib["weight_packed"], lib["weight_scale"], lib.get("weight_zero_point"), bits, not sym
    )
    assert torch.equal(back.q, qw.q)
    assert torch.equal(back.scales, qw.scales)
    assert (back.zeros is None) == sym
    if not sym:
        assert torch.equal(back.zeros, qw.zeros)
    assert back.group_size == qw.group_size


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_tokenizer_loads_offline_and_round_trips(tmp_path, fmt):
    from transformers import AutoTokenizer

    path = mc.make_checkpoint(tmp_path, fmt=fmt, **{**TINY, "layers": 1})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (path / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    text = "The quick brown fox jumps over the lazy dog; Ünïcode & 12345!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert max(ids) < config["vocab_size"] and len(tok) <= config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
        config["pad_token_id"],
    )
    assert generation["eos_token_id"] == tok.eos_token_id
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(prompt)["input_ids"]) == prompt


# ---------------------------------------------------------------- seeds, errors, CLI


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = mc.make_checkpoint(tmp_path / "a", fmt="gptq", seed=3, **TINY)
    b = mc.make_checkpoint(tmp_path / "b", fmt="gptq", seed=3, **TINY)
    c = mc.make_checkpoint(tmp_path / "c", fmt="gptq", seed=4, **TINY)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            dict(fmt="exl2"),
            r"fmt='exl2' is not supported; supported: \['gptq', 'awq', 'compressed-tensors'\]",
            id="fmt",
        ),
        pytest.param(dict(fmt="gptq", arch="llama"), r"arch='llama' is not supported", id="arch"),
        pytest.param(
            dict(fmt="awq", bits=8), r"fmt='awq' with bits=8: AWQ GEMM checkpoints are 4-bit only", id="awq-int8"
        ),
        pytest.param(dict(fmt="gptq", bits=3), r"bits=3 is not supported; supported: 4, 8", id="bits"),
        pytest.param(dict(fmt="gptq", group_size=48), r"group_size=48 does not divide hidden=128", id="gs-hidden"),
        pytest.param(
            dict(fmt="gptq", group_size=64, intermediate=96),
            r"group_size=64 does not divide intermediate=96",
            id="gs-inter",
        ),
        pytest.param(dict(fmt="gptq", group_size=0), r"group_size=0 is not supported", id="gs-zero"),
        pytest.param(dict(fmt="gptq", hidden=100), r"hidden=100 must be a positive multiple of 32", id="hidden"),
        pytest.param(dict(fmt="gptq", top_k=5), r"1 <= top_k <= experts", id="top_k"),
        pytest.param(
            dict(fmt="awq", checkpoint_format="gptq_v2"),
            r"checkpoint_format='gptq_v2' applies to fmt='gptq' only",
            id="ckpt-fmt",
        ),
        pytest.param(
            dict(fmt="gptq", checkpoint_format="v3"), r"checkpoint_format='v3' is not supported", id="ckpt-fmt-unknown"
        ),
        pytest.param(
            dict(fmt="awq", desc_act=True),
            r"desc_act=True applies to fmt='gptq' \(desc_act\) and "
            r"fmt='compressed-tensors' \(actorder: group\) only",
            id="desc_act",
        ),  # fmt: skip
        pytest.param(
            dict(fmt="compressed-tensors", group_size=-1, desc_act=True),
            r"actorder: group\) needs a group",
            id="desc_act-channelwise",
        ),  # fmt: skip
        pytest.param(
            dict(fmt="compressed-tensors", group_size=32, group_size_null=True),
            r"group_size_null=True .* group_size=32",
            id="gs-null",
        ),
        pytest.param(
            dict(fmt="gptq", vocab_size=100), r"vocab_size=100 is smaller than the tokenizer's 512 tokens", id="vocab"
        ),
    ],
)
def test_invalid_arguments_raise_value_error(tmp_path, kwargs, message):
    args = {"hidden": 128, "intermediate": 128, "experts": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        mc.make_checkpoint(tmp_path, **args)
    assert not (tmp_path / "config.json").exists()


def test_cli_writes_checkpoint_and_rejects_bad_args(tmp_path):
    parser = mc.add_make_checkpoint_args(argparse.ArgumentParser())
    out = tmp_path / "ct"
    args = parser.parse_args(
        [str(out), "--format", "compressed-tensors", "--bits", "8", "--group-size", "-1", "--asym", "--arch", "mixtral",
         "--hidden", "64", "--intermediate", "64", "--experts", "2", "--top-k", "1", "--layers", "1",
         "--no-quantize-attention", "--group-size-null", "--seed", "5"]
    )  # fmt: skip
    assert mc.run_make_checkpoint(args) == 0
    spec = mc.load_spec(out)
    assert spec == mc.CheckpointSpec(
        fmt="compressed-tensors", bits=8, group_size=-1, sym=False, arch="mixtral", hidden=64, intermediate=64,
        experts=2, top_k=1, layers=1, quantize_attention=False, seed=5, group_size_null=True,
    )  # fmt: skip
    defaults = parser.parse_args([str(tmp_path / "d"), "--format", "gptq"])
    assert (defaults.sym, defaults.group_size, defaults.checkpoint_format, defaults.quantize_attention) == (
        True,
        128,
        "gptq",
        True,
    )
    bad = parser.parse_args([str(tmp_path / "bad"), "--format", "awq", "--bits", "8"])
    with pytest.raises(ValueError, match="--format awq with --bits 8: AWQ GEMM checkpoints are 4-bit only"):
        mc.run_make_checkpoint(bad)  # cli.main reports it (tests/tools/test_cli.py)


# ---------------------------------------------------------------- vLLM reads the config blocks


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(fmt="gptq", bits=4, group_size=32), id="gptq"),
        pytest.param(dict(fmt="gptq", bits=8, group_size=-1, quantize_attention=False), id="gptq-int8-ch-noattn"),
        pytest.param(dict(fmt="awq", sym=False, group_size=32), id="awq"),
        pytest.param(dict(fmt="compressed-tensors", sym=False, group_size=32), id="ct"),
        pytest.param(dict(fmt="compressed-tensors", group_size=-1, group_size_null=True), id="ct-ch-null"),
    ],
)
def test_vllm_parses_the_quantization_config(tmp_path, kwargs):
    """vLLM 0.26's own config classes accept the block (asymmetric GPTQ is left to the plugin)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    path = mc.make_checkpoint(tmp_path, **{**TINY, "layers": 1, **kwargs})
    block = json.loads((path / "config.json").read_text())["quantization_config"]
    cls = {"gptq": AutoGPTQConfig, "awq": AutoAWQConfig, "compressed-tensors": CompressedTensorsConfig}[kwargs["fmt"]]
    config = cls.from_config(block)
    if kwargs["fmt"] == "gptq":
        assert (config.weight_bits, config.group_size) == (kwargs["bits"], kwargs["group_size"])
        assert config.dynamic == ({} if kwargs.get("quantize_attention", True) else {"-:.*self_attn.*": {}})
    elif kwargs["fmt"] == "awq":
        assert (config.weight_bits, config.zero_point, config.modules_to_not_convert) == (4, True, ["mlp.gate"])
    else:
        assert config.ignore == ["lm_head", "re:.*mlp.gate$"]


def test_act_order_gives_gate_and_up_of_an_expert_one_order(tmp_path):
    """GPTQ sorts K by the input's Hessian, which gate and up share: one g_idx per expert for both (the
    layout the triton backend sorts once), another for down, and a fresh one per expert."""
    path = mc.make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, desc_act=True, hidden=128,
                              intermediate=64, experts=3, top_k=2, layers=1, seed=4)  # fmt: skip
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        g = {k.split("experts.")[1]: f.get_tensor(k) for k in f.keys() if ".experts." in k and k.endswith("g_idx")}
    trivial = torch.arange(128) // 32
    for e in range(3):
        assert torch.equal(g[f"{e}.gate_proj.g_idx"], g[f"{e}.up_proj.g_idx"])
        assert not torch.equal(g[f"{e}.gate_proj.g_idx"].long(), trivial)
    assert not torch.equal(g["0.gate_proj.g_idx"], g["1.gate_proj.g_idx"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # an out-of-memory traceback before
        (dict(vocab_size=10**12), r"would write about .* GiB .*over make-checkpoint.s 8 GiB"),
        (dict(experts=100_000), r"experts=100000, .*would write about"),
        (dict(layers=10**8), r"layers=100000000: at most 4096 layers"),  # ran for minutes
    ],
)
def test_sizes_beyond_a_test_checkpoint_are_refused_before_writing(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mc.make_checkpoint(tmp_path / "ck", fmt="gptq", **kwargs)
    assert not (tmp_path / "ck").exists()


def test_a_failed_write_leaves_no_new_directory(tmp_path, monkeypatch):
    from vllm_wna16_plugin.tools import make_checkpoint as mk
    from vllm_wna16_plugin.tools.cli import main

    def fail(out, spec):
        Path(out).mkdir(parents=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mk, "write_checkpoint", fail)
    assert main(["make-checkpoint", str(tmp_path / "new"), "--format", "gptq"]) == 2  # reported, not raised
    assert not (tmp_path / "new").exists()


def test_without_the_float_reference_the_same_model_is_written_and_larger_sizes_fit(tmp_path):
    """float_reference=False (bench/e2e.py's many-layer checkpoints): model.safetensors byte-identical to the default's,
    the reference file holds the spec only, load_reference refuses it by name, and a size over the cap with the float
    reference fits without it; the cap's message names the way out."""
    from vllm_wna16_plugin.tools.cli import main

    a = mc.make_checkpoint(tmp_path / "a", fmt="gptq", seed=5, **TINY)
    b = mc.make_checkpoint(tmp_path / "b", fmt="gptq", seed=5, float_reference=False, **TINY)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert mc.load_reference(a) and not mc.load_spec(b).float_reference
    with pytest.raises(ValueError, match=r"without its float reference \(make-checkpoint --no-float-reference\)"):
        mc.load_reference(b)
    big = dict(fmt="gptq", experts=128, hidden=2048, intermediate=768, layers=16)
    with pytest.raises(ValueError, match=r"would write about .* GiB .*float_reference=False"):
        mc.CheckpointSpec(**big)
    assert mc.CheckpointSpec(**big, float_reference=False).written_bytes < mc.MAX_WRITTEN_BYTES  # 4.8 GB of int4
    assert main(["make-checkpoint", str(tmp_path / "c"), "--format", "gptq", "--no-float-reference"]) == 0
    assert not mc.load_spec(tmp_path / "c").float_reference
