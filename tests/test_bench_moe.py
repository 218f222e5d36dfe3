"""bench/bench_moe.py's table (CPU): which plugin column the speed-up ratios are of."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


@pytest.fixture()
def bench(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(shape, m, prov, us, frac=0.5):
    return (shape, m, prov, (us, us, us, frac))


def test_ratios_are_of_plugin_auto_when_it_ran_not_of_the_best_form(bench):
    providers = ["plugin-auto", "plugin-triton-td", "vllm-marlin"]
    rows = [_row("s", 8, "plugin-auto", 100.0, 0.3), _row("s", 8, "plugin-triton-td", 50.0, 0.6),
            _row("s", 8, "vllm-marlin", 80.0)]  # fmt: skip
    line = bench.render(rows, providers).splitlines()[2]
    # best column names the fastest form, but %bw and × vs marlin are auto's: 30%, 0.80 (not 60%, 1.60)
    assert line == "| s | 8 | 100.0 | 50.0 | 80.0 | triton-td | 30% | 0.80 |", line


def test_without_plugin_auto_the_ratios_are_of_the_best_plugin_provider(bench):
    rows = [_row("s", 8, "plugin-triton", 100.0, 0.3), _row("s", 8, "plugin-cuda", 50.0, 0.6),
            _row("s", 8, "vllm-marlin", 80.0), ("s", 8, "vllm-cuda", ("crash", "boom"))]  # fmt: skip
    head, _, line = bench.render(rows, ["plugin-triton", "plugin-cuda", "vllm-marlin", "vllm-cuda"]).splitlines()
    assert "%bw (best)" in head
    assert line == "| s | 8 | 100.0 | 50.0 | 80.0 | crash | cuda | 60% | 1.60 | - |", line


def test_mm_column_is_the_share_of_the_matmul_rate(bench):
    """%mm: the layer's 6*M*top_k*H*I FLOPs over auto's time, against the measured bf16 matmul rate."""

    class S:
        top_k, H, I = 8, 2048, 768  # noqa: E741

    flops = bench.layer_flops(S, 4096)
    assert flops == 6 * 4096 * 8 * 2048 * 768
    rows = [_row("s", 4096, "plugin-auto", 1000.0), _row("s", 4096, "vllm-marlin", 1500.0)]
    rate = flops / 1000e-6 / 0.4  # auto reached 40% of it
    head, _, line = bench.render(rows, ["plugin-auto", "vllm-marlin"], {("s", 4096): flops}, rate).splitlines()
    assert "%mm (auto)" in head
    assert line == "| s | 4096 | 1000.0 | 1500.0 | auto | 50% | 40% | 1.50 |", line
    assert "%mm" not in bench.render(rows, ["plugin-auto", "vllm-marlin"]).splitlines()[0]


def test_the_alt_provider_reads_its_own_config_dir_and_no_other_provider_does(bench, tmp_path, monkeypatch):
    import json

    from vllm_wna16_plugin.kernels.triton import configs

    entry = configs.TritonMoEConfig(32, 64, 64, GROUP_SIZE_M=8, maxnreg=128)
    name = configs.config_file_name(4, 256, 512, 128, 4, "GPU X")
    (tmp_path / name).write_text(json.dumps({"64": entry.to_dict()}))
    monkeypatch.setattr(bench, "ALT_CONFIG_DIRS", bench.alt_config_dirs([str(tmp_path), f"rule2={tmp_path / 'b'}"]))
    get = lambda d=None: configs.get_triton_moe_config(64, 4, 256, 512, 2, 128, 4, "GPU X", d)  # noqa: E731
    shipped = get()  # no file in the package for "GPU X": the heuristic
    assert shipped == configs.default_config(64, 4, 256, 512, 2, 128, 4)
    alt = bench.provider_options("plugin-triton-alt")
    assert alt.config_dir == tmp_path and get(alt.config_dir) == entry
    assert bench.provider_options("plugin-triton-auto").config_dir is None and get() == shipped
    assert bench.provider_options("plugin-triton-alt-rule2").config_dir == tmp_path / "b"
    with pytest.raises(bench.NotApplicable, match="--alt-config-dir other=DIR"):
        bench.provider_options("plugin-triton-alt-other")
    monkeypatch.setattr(bench, "ALT_CONFIG_DIRS", {})
    with pytest.raises(bench.NotApplicable, match="--alt-config-dir DIR"):
        bench.provider_options("plugin-triton-alt")


def test_named_alt_config_dirs_are_parsed_and_refused_by_name(bench):
    dirs = bench.alt_config_dirs(["d0", "s128=d1", "s256=/x/d2"])
    assert dirs == {"plugin-triton-alt": Path("d0"), "plugin-triton-alt-s128": Path("d1"),
                    "plugin-triton-alt-s256": Path("/x/d2")}  # fmt: skip
    with pytest.raises(ValueError, match="named twice"):
        bench.alt_config_dirs(["a=d1", "a=d2"])
    with pytest.raises(ValueError, match="NAME must be"):
        bench.alt_config_dirs(["a-b=d1"])


def test_every_kernel_form_provider_names_valid_kernel_options(bench):
    # each form is a KernelOptions value (built, so checked), and only the form's own fields differ
    from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS

    for prov, form in {**bench.TRITON_FORMS, **bench.CUDA_FORMS}.items():
        if prov == "plugin-triton-alt":
            continue
        opts = bench.provider_options(prov)
        changed = {k for k in form if getattr(opts, k) != getattr(DEFAULT_OPTIONS, k)}
        assert changed == {k for k, v in form.items() if v != getattr(DEFAULT_OPTIONS, k)}, prov
    assert bench.provider_options("plugin-cuda-tiles").cuda_stream is False
    assert bench.provider_options("plugin-triton-td").use_td is True


# ---------------------------------------------------------------- any model's shape (bench/model_shapes.py)

# The routed-experts fields of real public config.json files (Hugging Face), as they are there.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "decoder_sparse_step": 1,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
}  # fmt: skip
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "first_k_dense_replace": 1, "num_attention_heads": 16,
}  # fmt: skip
GLM_4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "num_hidden_layers": 46, "first_k_dense_replace": 1, "num_attention_heads": 96,
}  # fmt: skip
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_attention_heads": 16,
}  # fmt: skip
QWEN3_5_35B_A3B_GPTQ = {  # multimodal: the language model under text_config; a GPTQ gs32 quantization_config
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
                    "num_hidden_layers": 40, "num_attention_heads": 16},
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
}  # fmt: skip
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "num_hidden_layers": 24,
    "num_attention_heads": 64, "quantization_config": {"quant_method": "mxfp4"},
}  # fmt: skip
LLAMA4_SCOUT = {  # the experts' intermediate_size; intermediate_size_mlp is the dense layers'
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
    "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
                    "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1,
                    "num_attention_heads": 40},
}  # fmt: skip


@pytest.fixture()
def shapes(monkeypatch):
    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))
    monkeypatch.delitem(sys.modules, "model_shapes", raising=False)
    import model_shapes

    return model_shapes


def _dims(s):
    return (s.E, s.top_k, s.H, s.I, s.gs, s.bits, s.group_w13, s.group_w2)


@pytest.mark.parametrize(
    ("config", "tp", "dims"),
    [
        # (E, top_k, H, I per rank, scheme group, bits, gate/up group, down group): I // tp, E whole
        (QWEN3_30B_A3B, 1, (128, 8, 2048, 768, 128, 4, 128, 128)),
        (QWEN3_30B_A3B, 2, (128, 8, 2048, 384, 128, 4, 128, 128)),
        (QWEN3_30B_A3B, 4, (128, 8, 2048, 192, 128, 4, 128, 64)),  # 192 = 1.5 groups: re-grouped exactly
        (QWEN3_30B_A3B, 8, (128, 8, 2048, 96, 128, 4, 128, 32)),
        (MIXTRAL_8X7B, 1, (8, 2, 4096, 14336, 128, 4, 128, 128)),
        (MIXTRAL_8X7B, 2, (8, 2, 4096, 7168, 128, 4, 128, 128)),
        (MIXTRAL_8X7B, 4, (8, 2, 4096, 3584, 128, 4, 128, 128)),
        (MIXTRAL_8X7B, 8, (8, 2, 4096, 1792, 128, 4, 128, 128)),
        (DEEPSEEK_V2_LITE, 1, (64, 6, 2048, 1408, 128, 4, 128, 128)),
        (DEEPSEEK_V2_LITE, 2, (64, 6, 2048, 704, 128, 4, 128, 64)),
        (DEEPSEEK_V2_LITE, 4, (64, 6, 2048, 352, 128, 4, 128, 32)),
        (DEEPSEEK_V2_LITE, 8, (64, 6, 2048, 176, 128, 4, 128, 16)),
        (GLM_4_5_AIR, 1, (128, 8, 4096, 1408, 128, 4, 128, 128)),
        (GLM_4_5_AIR, 8, (128, 8, 4096, 176, 128, 4, 128, 16)),
        (OLMOE_1B_7B, 1, (64, 8, 2048, 1024, 128, 4, 128, 128)),  # num_experts + intermediate_size
        (OLMOE_1B_7B, 8, (64, 8, 2048, 128, 128, 4, 128, 128)),
        (QWEN3_5_35B_A3B_GPTQ, 1, (256, 8, 2048, 512, 32, 4, 32, 32)),  # text_config; gs32 from the checkpoint
        (QWEN3_5_35B_A3B_GPTQ, 2, (256, 8, 2048, 256, 32, 4, 32, 32)),
        (QWEN3_5_35B_A3B_GPTQ, 4, (256, 8, 2048, 128, 32, 4, 32, 32)),
        (QWEN3_5_35B_A3B_GPTQ, 8, (256, 8, 2048, 64, 32, 4, 32, 32)),
        (LLAMA4_SCOUT, 8, (16, 1, 5120, 1024, 128, 4, 128, 128)),
    ],
)
def test_real_configs_give_the_shape_vllm_shards(shapes, config, tp, dims):
    s = shapes.model_moe_shape(config, tp, name="m")
    assert _dims(s) == dims
    assert s.name == f"m@tp{tp}" + ("-int4-g32" if dims[4] == 32 else "")


def test_the_fixed_shapes_are_the_derived_ones(shapes, bench):
    """The built-in SHAPES of the tuned models are what their configs give at TP 1."""
    fixed = {s.name: s for s in bench.SHAPES}
    for name, cfg, gs in (("qwen3-30b-a3b", QWEN3_30B_A3B, None), ("mixtral-8x7b", MIXTRAL_8X7B, None),
                          ("deepseek-v2-lite", DEEPSEEK_V2_LITE, None), ("qwen3.5-35b-a3b", QWEN3_5_35B_A3B_GPTQ, None)):  # fmt: skip
        assert _dims(shapes.model_moe_shape(cfg, 1, group_size=gs)) == _dims(fixed[name]), name
    ch = fixed["ct-channelwise"]  # channel-wise: one group over each K
    assert (ch.group_w13, ch.group_w2) == (ch.H, ch.I)


def test_names_notes_and_overrides(shapes):
    s = shapes.model_moe_shape(QWEN3_30B_A3B, 4, name="Qwen3-30B-A3B")
    assert s.name == "Qwen3-30B-A3B@tp4" and s.gs_w2 == 64 and s.gs_w13 is None
    assert "moe_intermediate_size=768 / tp 4 = 192" in s.note and "qwen3_moe.py" in s.note
    assert "down re-grouped 128 -> 64" in s.note and "defaults" in s.note
    assert shapes.model_moe_shape(QWEN3_30B_A3B, 1).name == "qwen3_moe@tp1"  # no name: the model_type
    q = shapes.model_moe_shape(QWEN3_5_35B_A3B_GPTQ, 8, name="Qwen3.5-35B-A3B")
    assert "text_config.num_experts=256" in q.note and "quantization_config (gptq)" in q.note
    # flags override the checkpoint's, one at a time
    s8 = shapes.model_moe_shape(QWEN3_5_35B_A3B_GPTQ, 1, bits=8, name="q")
    assert (s8.bits, s8.gs, s8.name) == (8, 32, "q@tp1-int8-g32") and "--bits" in s8.note
    ch = shapes.model_moe_shape(MIXTRAL_8X7B, 2, group_size=-1, name="mx")
    assert (ch.gs, ch.group_w13, ch.group_w2, ch.name) == (-1, 4096, 7168, "mx@tp2-int4-ch")
    # a quantization_config that is not WNA16 is not read, and says so
    g = shapes.model_moe_shape(GPT_OSS_20B, 2, group_size=32, name="gpt-oss-20b")
    assert _dims(g) == (32, 4, 2880, 1440, 32, 4, 32, 32)
    assert "'mxfp4' is not WNA16" in g.note and "swigluoai" in g.note
    assert shapes.model_moe_shape(GPT_OSS_20B, 4, group_size=32).group_w2 == 16  # 720 = 22.5 groups of 32


def test_expert_parallel_splits_the_experts_not_i(shapes):
    s = shapes.model_moe_shape(QWEN3_30B_A3B, 8, ep=True, name="q")
    assert (s.E, s.I, s.group_w2, s.name) == (16, 768, 128, "q@tp8-ep")
    uneven = shapes.model_moe_shape({**OLMOE_1B_7B, "num_attention_heads": 48}, 3, ep=True)
    assert uneven.E == 22 and "num_experts=64 over 3 EP ranks: 22 on rank 0" in uneven.note  # ceil(64 / 3)
    with pytest.raises(ValueError, match=r"tp=3 with expert parallelism .*num_attention_heads=16 is not divisible"):
        shapes.model_moe_shape(OLMOE_1B_7B, 3, ep=True)  # vLLM still splits attention over the TP ranks


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        (
            {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336},
            {},
            r"no routed-experts count: none of moe_num_experts, n_routed_experts, num_experts, num_local_experts .*"
            r"understood spellings: num_experts \+ num_experts_per_tok \+ moe_intermediate_size",
        ),
        (
            {"num_experts": 64, "hidden_size": 2048},
            {},
            r"has num_experts but is missing num_experts_per_tok and moe_intermediate_size \(the Qwen.* spelling\) or "
            r"num_experts_per_tok and intermediate_size \(the OLMoE spelling\); understood spellings",
        ),
        (
            {"text_config": {"n_routed_experts": 64, "moe_intermediate_size": 1408, "hidden_size": 2048}},
            {},
            r"has text_config.n_routed_experts but is missing text_config.num_experts_per_tok",
        ),
        ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, {}, r"num_experts_per_tok=9 is larger than num_local_experts=8"),
        ({**MIXTRAL_8X7B, "hidden_size": "4096"}, {}, r"hidden_size='4096' is not a positive int"),
        ({**MIXTRAL_8X7B, "num_local_experts": True}, {}, r"num_local_experts=True is not a positive int"),
        (
            MIXTRAL_8X7B,
            {"tp": 3},
            r"tp=3 cannot load .*intermediate_size=14336 is not divisible by tp=3 .*TP sizes that work: 1, 2, 4, 8, 16$",
        ),
        (
            DEEPSEEK_V2_LITE,
            {"tp": 16},
            r"tp=16 cannot load .*K=88 per rank .*re-grouping to gcd\(group_size, K\)=8 needs at least 16.*TP sizes "
            r"that work: 1, 2, 4, 8$",
        ),
        (GLM_4_5_AIR, {"tp": 16}, r"K=88 per rank"),
        (GPT_OSS_20B, {"tp": 8, "group_size": 32}, r"K=360 per rank .*TP sizes that work: 1, 2, 4$"),  # heads: no 3
        (GPT_OSS_20B, {}, r"int4 group 128 .*cannot quantize this model's experts at any TP size: .*K=2880"),
        (OLMOE_1B_7B, {"tp": 3}, r"intermediate_size=1024 is not divisible by tp=3"),
        ({**OLMOE_1B_7B, "intermediate_size": 1026}, {"tp": 2}, r"tp=2 cannot load .*does not divide the full K=1026"),
        (QWEN3_30B_A3B, {"tp": 0}, r"tp=0 is not a positive int"),
        (QWEN3_30B_A3B, {"bits": 3}, r"--bits=3 is not supported; supported: 4, 8"),
        (QWEN3_30B_A3B, {"group_size": 0}, r"--group-size=0 is not supported"),
        (
            {**QWEN3_30B_A3B, "quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}},
            {},
            r"bits=3 is not supported",
        ),  # a WNA16 quantization_config is parsed by the plugin, errors and all
        ([1, 2], {}, r"config must be a dict"),
    ],
)
def test_bad_configs_and_tp_sizes_say_why(shapes, config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        shapes.model_moe_shape(config, **kwargs)


def _write(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_cli_dry_run_prints_the_model_shapes_without_a_gpu(bench, tmp_path, capsys):
    qwen = _write(tmp_path, "Qwen3-30B-A3B", QWEN3_30B_A3B)
    ds = _write(tmp_path, "DeepSeek-V2-Lite", DEEPSEEK_V2_LITE)
    rc = bench.main(["--model-config", str(qwen), "--model-config", str(ds / "config.json"), "--tp", "1,4",
                     "--m", "1,16", "--providers", "plugin-auto,vllm-marlin", "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    heads = [ln for ln in lines if not ln.startswith(" ")][:4]
    assert heads == [
        "Qwen3-30B-A3B@tp1: E=128 top_k=8 H=2048 I=768 int4 group 128 (gate/up K=2048 group 128, down K=768 group 128)",
        "Qwen3-30B-A3B@tp4: E=128 top_k=8 H=2048 I=192 int4 group 128 (gate/up K=2048 group 128, down K=192 group 64)",
        "DeepSeek-V2-Lite@tp1: E=64 top_k=6 H=2048 I=1408 int4 group 128 (gate/up K=2048 group 128, down K=1408 "
        "group 128)",
        "DeepSeek-V2-Lite@tp4: E=64 top_k=6 H=2048 I=352 int4 group 128 (gate/up K=2048 group 128, down K=352 group 32)",
    ]
    assert "M: 1,16" in lines and "providers: plugin-auto,vllm-marlin" in lines
    assert "  experts' weights per copy: int4 0.31 GB, bf16 1.21 GB" in lines  # Qwen3-30B-A3B at TP 1


def test_cli_without_model_config_keeps_the_built_in_shapes(bench, tmp_path, capsys):
    assert bench.main(["--dry-run"]) == 0
    names = [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines() if not ln.startswith(" ")]
    assert names[: len(bench.SHAPES)] == [s.name for s in bench.SHAPES]
    qwen = _write(tmp_path, "Q", QWEN3_30B_A3B)
    assert bench.main(["--model-config", str(qwen), "--shapes", "mixtral-8x7b", "--tp", "8", "--dry-run"]) == 0
    names = [
        ln.split(":")[0]
        for ln in capsys.readouterr().out.splitlines()
        if not ln.startswith(("  ", "M:", "prov", "dtype:"))
    ]
    assert names == ["mixtral-8x7b", "Q@tp8"]


def test_cli_errors_are_clear(bench, tmp_path, capsys):
    ds = _write(tmp_path, "DeepSeek-V2-Lite", DEEPSEEK_V2_LITE)
    assert bench.main(["--model-config", str(ds), "--tp", "16", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bench_moe.py: error: {ds}: tp=16 cannot load") and "TP sizes that work: 1, 2, 4, 8" in err
    assert bench.main(["--model-config", str(tmp_path / "nope"), "--dry-run"]) == 2
    assert "no such file (a config.json, or a directory holding one)" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert bench.main(["--model-config", str(tmp_path / "bad.json"), "--dry-run"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert bench.main(["--shapes", "nope", "--dry-run"]) == 2
    assert "--shapes: unknown nope; built-in shapes: qwen3-30b-a3b" in capsys.readouterr().err
    assert bench.main(["--ep", "--dry-run"]) == 2
    assert "--ep applies to --model-config and --catalog shapes" in capsys.readouterr().err
    assert bench.main(["--model-config", str(ds), "--tp", "4", "--ep"]) == 2  # EP: shapes only, before any GPU
    assert "--ep shapes are printed by --dry-run, not timed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", "two"])
    assert "'two' is not a comma-separated list of ints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--m", "0,4"])


def test_split_group_sizes_make_the_problem_the_layer_makes(bench, shapes):
    """Qwen3-30B-A3B at TP 8: gate/up in groups of 128, down (K=96) re-grouped to 32; on CPU tensors."""
    import torch

    from vllm_wna16_plugin import packing

    s = shapes.model_moe_shape({**QWEN3_30B_A3B, "num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 256}, 8)
    assert (s.group_w13, s.group_w2, s.gs_w2) == (128, 32, 32)
    gen = torch.Generator().manual_seed(0)
    q13 = packing.quantize_rtn(torch.randn(s.E, 2 * s.I, s.H, generator=gen), 4, s.group_w13, False)
    q2 = packing.quantize_rtn(torch.randn(s.E, s.H, s.I, generator=gen), 4, s.group_w2, False)
    k13, k2 = packing.to_kernel_layout(q13, torch.bfloat16), packing.to_kernel_layout(q2, torch.bfloat16)
    w = bench.Weights(k13.qweight, k2.qweight, k13.scales, k2.scales)
    x, ids = torch.randn(3, s.H).to(torch.bfloat16), torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    p = bench.layer_problem(x, w, ids, s.gs, bits=s.bits, gs_w2=s.gs_w2)
    got = (p.group_size_w13, p.group_size_w2, p.scheme.group_size, p.intermediate, p.num_experts)
    assert got == (128, 32, 128, 96, 4)
    with pytest.raises(ValueError, match="group_size=128 does not divide w2_scales's K=96|w2_scales has 3 scale"):
        bench.layer_problem(x, w, ids, s.gs, bits=s.bits)  # one group size cannot describe these tensors
    # the byte count reads each GEMM's own scales: 3HI/2 bytes + (2I * H/128 + H * I/32) bf16 scales
    assert bench.weight_bytes_per_expert(s, 4, False) == 3 * 256 * 96 / 2 + (2 * 96 * 2 + 256 * 3) * 2


def test_what_the_bench_does_not_time_is_said(shapes):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    s = shapes.model_moe_shape({**QWEN3_30B_A3B, "quantization_config": awq}, 2)
    assert "quantization_config (awq)" in s.note and "timed symmetric, without the checkpoint's zero points" in s.note
    act = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True}
    assert "timed without act order" in shapes.model_moe_shape({**QWEN3_30B_A3B, "quantization_config": act}, 2).note
    # K=192 per rank, 1.5 groups of 128: formerly refused ("act order is never re-grouped"); the triton
    # backend pads a rank's act-order groups, and the bench times the layer re-grouped, without act order
    at_tp4 = shapes.model_moe_shape({**QWEN3_30B_A3B, "quantization_config": act}, 4)
    assert "timed without act order" in at_tp4.note and (at_tp4.I, at_tp4.group_w2) == (192, 64)


def test_catalog_sets_are_disjoint_and_every_model_resolves_at_tp1(bench, capsys):
    import model_catalog

    dev = {n for n, _ in model_catalog.catalog_configs("dev")}
    val = {n for n, _ in model_catalog.catalog_configs("validation")}
    assert dev and val and not dev & val and dev | val == set(model_catalog.CATALOG)
    assert bench.main(["--catalog", "all", "--tp", "1", "--dry-run"]) == 0
    out = capsys.readouterr()
    names = {ln.split("@")[0] for ln in out.out.splitlines() if "@tp1" in ln and not ln.startswith(" ")}
    assert names == dev | val, out.err  # each model's layer at TP 1, none skipped
    with pytest.raises(ValueError, match="--catalog='train'"):
        model_catalog.catalog_configs("train")


def test_catalog_skips_a_tp_size_a_model_cannot_split_at_and_says_why(bench, capsys):
    assert bench.main(["--catalog", "validation", "--tp", "8", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "--catalog: Qwen2-57B-A14B at tp=8 skipped: " in out.err and "num_attention_heads=28" in out.err
    assert "Mixtral-8x22B@tp8: E=8 top_k=2 H=6144 I=2048" in out.out


def test_every_catalog_model_gives_the_tuner_a_problem(bench, tmp_path):
    # `vllm-wna16 tune` and doctor read config.json alone: the catalog's written configs resolve as loading does
    import json

    import model_catalog

    from vllm_wna16_plugin.tools.doctor import moe_problems

    for name in model_catalog.CATALOG:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(model_catalog.checkpoint_config(name, group_size=32)))
        if model_catalog.CATALOG[name][1].get("model_type") == "gpt_oss":  # biased experts: loading refuses them
            with pytest.raises(ValueError, match=r"model_type 'gpt_oss': .*a bias on each expert's GEMMs"):
                moe_problems(path, 1, "cuda", 90)
            continue
        [(group, problem)] = moe_problems(path, 1, "cuda", 90)
        _, cfg = model_catalog.CATALOG[name]
        assert problem.top_k == cfg.get("text_config", cfg).get("num_experts_per_tok", cfg.get("moe_k")), name
        assert group.scheme.group_size == 32 and problem.group_size_w13 == 32


@pytest.mark.parametrize(
    ("prov", "zero_points", "dtype"),
    [
        ("plugin-reference-ao", False, "bfloat16"),
        ("plugin-triton-auto-ao", False, "bfloat16"),
        ("plugin-reference-ao", True, "float16"),  # --zero-points --dtype float16: the zeros follow g_idx's groups
        ("plugin-triton-auto-ao", True, "float16"),
    ],
)
def test_act_order_providers_run_the_checkpoint_the_reference_means(bench, shapes, prov, zero_points, dtype):
    """make_act_order's twin: K rows of both GEMMs shuffled per expert with g_idx naming their groups; the
    plugin (sorting it at load as it sorts a real checkpoint) must give x @ W[:, P], the reference's, on
    fresh random data (and the base weights' result must differ, so a lost permutation would show)."""
    import torch

    from vllm_wna16_plugin.reference import fused_moe_ref

    s = shapes.Shape("ao", 4, 2, 128, 64, 32)
    gen = torch.Generator().manual_seed(7)
    dtype = bench.DTYPES[dtype]
    k13, k2, d13, d2 = bench.shape_weights(s, gen, dtype, zero_points, device="cpu")
    w, d13_ao, d2_ao = bench.make_act_order(k13, k2, d13, d2, s, 4, gen)
    assert w.g13.shape == (s.E, 2, s.H) and w.g2.shape == (s.E, s.I)
    assert (w.qzeros13 is k13.qzeros and w.qzeros2 is k2.qzeros) and (w.qzeros13 is not None) == zero_points
    x = torch.randn(5, s.H, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(5, s.E, generator=gen).softmax(-1), 2, dim=-1)
    ids = ids.to(torch.int32)
    want = fused_moe_ref(x, d13_ao, d2_ao, weights, ids).float()
    got = bench.plugin_backend(prov, x, w, ids, s.gs).run(x, weights, ids).float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    base = fused_moe_ref(x, d13, d2, weights, ids).float()
    assert ((base - want).norm() / want.norm()).item() > 0.5
    # kernel_breakdown.py's twin: the same kind of weights without the dequantized ones, runnable by -ao providers
    gen.manual_seed(7)
    w_only, none13, none2 = bench.make_act_order(k13, k2, None, None, s, 4, gen)
    assert none13 is None and none2 is None and w_only.g13.shape == w.g13.shape
    assert torch.isfinite(bench.plugin_backend(prov, x, w_only, ids, s.gs).run(x, weights, ids).float()).all()


# ---------------------------------------------------------------- --dtype and --zero-points (AWQ-like, fp16 layers)


def test_dtype_and_zero_points_are_parsed_with_the_old_defaults(bench, capsys):
    import torch

    args = bench.parse_args([])
    assert (args.dtype, args.zero_points) == ("bfloat16", False) and bench.options_note(args) == ""
    args = bench.parse_args(["--dtype", "float16", "--zero-points"])
    assert (args.dtype, args.zero_points) == ("float16", True)
    assert bench.DTYPES[args.dtype] is torch.float16
    assert bench.options_note(args) == "(float16, zero points)"
    assert bench.options_note(bench.parse_args(["--dtype", "float16"])) == "(float16, symmetric)"
    assert bench.options_note(bench.parse_args(["--zero-points"])) == "(bfloat16, zero points)"
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "float32"])
    assert "invalid choice: 'float32'" in capsys.readouterr().err


def test_dry_run_says_the_dtype_and_zero_points_and_counts_the_zeros(bench, capsys):
    # qwen3.5-35b-a3b (gs32): per expert 3HI/2 = 1572864 weight bytes + 98304 groups x 2 scale bytes (0.45 GB for
    # 256 experts), and with zero points 98304 x 4/8 zero bytes more (0.47 GB)
    assert bench.main(["--shapes", "qwen3.5-35b-a3b", "--m", "1", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "dtype: bfloat16; zero points: no (symmetric)" in lines
    assert "  experts' weights per copy: int4 0.45 GB, bf16 1.61 GB" in lines
    assert bench.main(["--shapes", "qwen3.5-35b-a3b", "--m", "1", "--dtype", "float16", "--zero-points",
                       "--dry-run"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert "dtype: float16; zero points: yes" in lines
    assert "  experts' weights per copy: int4 0.47 GB, fp16 1.61 GB" in lines


def test_an_awq_models_note_says_whether_its_zero_points_are_timed(bench, tmp_path, capsys):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    path = _write(tmp_path, "Qwen3-30B-A3B-AWQ", {**QWEN3_30B_A3B, "quantization_config": awq})
    assert bench.main(["--model-config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "timed symmetric, without the checkpoint's zero points" in out and "--zero-points" not in out
    assert bench.main(["--model-config", str(path), "--zero-points", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "timed with zero points (--zero-points), as the checkpoint holds them" in out
    assert "timed symmetric" not in out and "dtype: bfloat16; zero points: yes" in out


def test_crossovers_are_not_written_from_a_float16_or_zero_point_run(bench, capsys):
    # the crossover table's key names neither: such a run must not replace the bf16 symmetric entry
    for flags in (["--zero-points"], ["--dtype", "float16"]):
        assert bench.main(["--shapes", "qwen3-30b-a3b", "--write-crossover", "/nonexistent", *flags]) == 2
        assert "--write-crossover records bfloat16 symmetric layers only" in capsys.readouterr().err


def _small_shape(shapes, bits=4):
    return shapes.Shape("zp", 4, 2, 128, 64, 32, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_byte_accounting_counts_the_packed_zeros_the_tensors_hold(bench, shapes, bits):
    """weight_bytes_per_expert: (2I * H/gs + H * I/gs) zeros of bits/8 bytes on top of weights and scales, as
    many bytes as the kernel-layout tensors have (qweight + scales + qzeros, per expert)."""
    import torch

    s = _small_shape(shapes, bits)
    groups = 2 * s.I * (s.H // 32) + s.H * (s.I // 32)
    sym = 3 * s.H * s.I * bits / 8 + groups * 2
    assert bench.weight_bytes_per_expert(s, bits, False) == sym
    assert bench.weight_bytes_per_expert(s, bits, False, True) == sym + groups * bits / 8
    assert bench.weight_bytes_per_expert(s, bits, True, True) == 3 * s.H * s.I * 2  # dense: no zeros
    for zp in (False, True):
        kw13, kw2, _, _ = bench.shape_weights(s, torch.Generator().manual_seed(0), torch.float16, zp, device="cpu")
        held = sum(t.numel() * t.element_size() for kw in (kw13, kw2) for t in vars(kw).values() if t is not None)
        assert held / s.E == bench.weight_bytes_per_expert(s, bits, False, zp), zp


def test_zero_point_float16_weights_carry_the_zeros_and_dtype_to_every_path(bench, shapes):
    """--zero-points --dtype float16 on CPU: the kernel-layout zeros reach the Weights, each rotating copy (cloned),
    the plugin's KernelTensors and MoEProblem, and vLLM's quant config; the reference is (q - z) * s with the
    float16-rounded scales, the very values vLLM's moe_wna16 Triton kernel computes from those tensors."""
    import torch

    from vllm_wna16_plugin.reference import fused_moe_ref

    args = bench.parse_args(["--zero-points", "--dtype", "float16"])
    dtype = bench.DTYPES[args.dtype]
    s = _small_shape(shapes)
    gen = torch.Generator().manual_seed(3)
    kw13, kw2, d13, d2 = bench.shape_weights(s, gen, dtype, args.zero_points, device="cpu")
    w = bench.int_weights(kw13, kw2)
    assert w.qzeros13.shape == (s.E, 2 * s.I // 2, s.H // 32) and w.qzeros2.shape == (s.E, s.H // 2, s.I // 32)
    assert w.qzeros13.dtype == w.qzeros2.dtype == torch.uint8
    assert w.scales13.dtype == w.scales2.dtype == torch.float16
    # vLLM's fused_moe_kernel_gptq_awq: q = B[e, n, k // 2] >> (k % 2) * 4, zero = B_zp[e, n // 2, g] >> (n % 2) * 4
    # (4 bits each), w = (q - zero) * B_scale[e, n, g] in fp32: the reference's weights, exactly
    for kw, d in ((kw13, d13), (kw2, d2)):
        n, k = d.shape[1:]
        kk, nn = torch.arange(k), torch.arange(n)
        q = (kw.qweight[:, :, kk // 2].int() >> (kk % 2 * 4)) & 0xF
        z = (kw.qzeros[:, nn // 2, :].int() >> (nn % 2 * 4)[:, None]) & 0xF
        vllm_w = (q - z.repeat_interleave(32, -1)).float() * kw.scales.float().repeat_interleave(32, -1)
        assert torch.equal(vllm_w, d)
        assert not torch.equal(z, torch.full_like(z, 8))  # real zero points, not the symmetric midpoint
    copies = bench.rotating_copies(w, 3)
    for c in copies[1:]:
        for name in ("q13", "q2", "scales13", "scales2", "qzeros13", "qzeros2"):
            a, b = getattr(c, name), getattr(w, name)
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name  # a copy of its own, L2-cold
        assert c.g13 is None and c.dense13 is None
    kt = bench.kernel_tensors(copies[2])
    assert kt.w13_qzeros is copies[2].qzeros13 and kt.w2_qzeros is copies[2].qzeros2
    x = torch.randn(5, s.H, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(5, s.E, generator=gen).softmax(-1), 2, dim=-1)
    ids = ids.to(torch.int32)
    p = bench.layer_problem(x, copies[1], ids, s.gs)
    assert p.scheme.has_zero_point and p.act_dtype == torch.float16
    assert not bench.layer_problem(
        x, bench.Weights(w.q13, w.q2, w.scales13, w.scales2), ids, s.gs
    ).scheme.has_zero_point
    want = fused_moe_ref(x, d13, d2, weights, ids).float()
    got = bench.plugin_backend("plugin-reference", x, copies[1], ids, s.gs).run(x, weights, ids)
    assert got.dtype == torch.float16 and ((got.float() - want).norm() / want.norm()).item() < 2e-2
    # vLLM's in-tree path: the same zeros (its layout, see above) and scales go into its quant config
    seen = {}
    paths = object.__new__(bench.VllmPaths)
    paths.fm = type("FM", (), {"should_moe_wna16_use_cuda": staticmethod(lambda *a, **kw: True)})()
    paths.orig = paths.fm.should_moe_wna16_use_cuda
    paths.qc = {4: lambda **kw: kw}
    paths.fused_experts = lambda x, w1, w2, tw, ti, quant_config: seen.update(quant_config, w1=w1, w2=w2)
    paths.int4("vllm-triton", x, copies[1], weights, ids, s.gs)
    assert seen["w1_zp"] is copies[1].qzeros13 and seen["w2_zp"] is copies[1].qzeros2
    assert seen["w1_scale"] is copies[1].scales13 and seen["w1"] is copies[1].q13 and seen["block_shape"] == [0, 32]


def test_run_header_and_device_csv_record_the_dtype_and_zero_points(bench, tmp_path, monkeypatch):
    """The .md header says them (and results_table.parse_header reads the note back, as consolidate does); the
    device CSV's rows carry them in run_note; a default run's note stays empty, as every earlier run's is."""
    import results_table

    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    shape = bench.SHAPES[0]
    for flags, note, words in (
        ([], "", "bfloat16 activations and scales (bf16-dense: bfloat16 weights), symmetric (no zero points)"),
        (["--dtype", "float16", "--zero-points", "--tag=-awq"], "(float16, zero points)",
         "float16 activations and scales (bf16-dense: float16 weights), zero points"),
    ):  # fmt: skip
        args = bench.parse_args(flags)
        header = bench.run_header(args, [shape], "GPU X", 3e12, 800e12, ("0.34.0", "2.11", "3.6"))
        assert words in header
        md = tmp_path / f"run{len(flags)}.md"
        md.write_text(header)
        meta = results_table.parse_header(md)
        assert (meta["commit"], meta["run"], meta["run_note"]) == ("abc1234", f"abc1234{args.tag}", note)
        path = bench.append_to_device_csv(
            [(shape.name, 1, "plugin-auto", (10.0, 9.0, 11.0, 0.5))], tmp_path / "results.csv", tmp_path,
            date="2026-12-06", device="GPU X", versions=("0.34.0", "2.11", "3.6"), run=f"abc1234{args.tag}",
            copy_bw=3e12, reps=5, timing="queued", source=tmp_path / "x.csv", run_note=bench.options_note(args),
        )  # fmt: skip
        row = results_table.read(path)[-1]
        assert (row["run"], row["run_note"], row["shape"]) == (f"abc1234{args.tag}", note, shape.name)
