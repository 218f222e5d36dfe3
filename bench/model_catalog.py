"""Public MoE models' routed-experts fields, split into a development set and a validation set.

The launch plan's rules (when the CUDA kernel beats Triton, which tile, split and warps) are to be fitted on
measurements of the DEVELOPMENT models' layers and judged on the VALIDATION models', which no rule or tuned
entry may be fitted on (issue 22). Each entry holds the fields of the model's public config.json that
bench/model_shapes.py reads (as vLLM's model files read them); `bench_moe.py --catalog dev|validation|all
--tp 1,2,4,8` times every model's layer as one rank runs it at each TP size.

The split: the development set holds the five shapes the plugin was tuned on first (Qwen3-30B-A3B,
Mixtral-8x7B, DeepSeek-V2-Lite and the channel-wise and K=1344 bench shapes come from them) and models
of the same families; the validation set other families and sizes (small and large experts, top-1 and
top-10 routing, 16 to 512 experts), so that a rule that only memorised the development shapes shows it.
"""

from __future__ import annotations

from collections.abc import Mapping

DEV, VALIDATION = "dev", "validation"

# name: (set, the routed-experts fields of the model's config.json)
CATALOG: Mapping[str, tuple[str, dict]] = {
    "Qwen3-30B-A3B": (DEV, {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "num_attention_heads": 32}),
    "Qwen3-235B-A22B": (DEV, {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "num_attention_heads": 64}),
    "Qwen1.5-MoE-A2.7B": (DEV, {
        "model_type": "qwen2_moe", "hidden_size": 2048, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "num_attention_heads": 16}),
    "Mixtral-8x7B": (DEV, {
        "model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 14336, "num_attention_heads": 32}),
    "DeepSeek-V2-Lite": (DEV, {
        "model_type": "deepseek_v2", "hidden_size": 2048, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "num_attention_heads": 16}),
    "GLM-4.5-Air": (DEV, {
        "model_type": "glm4_moe", "hidden_size": 4096, "n_routed_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408, "num_attention_heads": 96}),
    "OLMoE-1B-7B": (DEV, {
        "model_type": "olmoe", "hidden_size": 2048, "num_experts": 64, "num_experts_per_tok": 8,
        "intermediate_size": 1024, "num_attention_heads": 16}),
    "Phi-3.5-MoE": (DEV, {
        "model_type": "phimoe", "hidden_size": 4096, "num_local_experts": 16, "num_experts_per_tok": 2,
        "intermediate_size": 6400, "num_attention_heads": 32}),
    "Mixtral-8x22B": (VALIDATION, {
        "model_type": "mixtral", "hidden_size": 6144, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 16384, "num_attention_heads": 48}),
    "DeepSeek-V3": (VALIDATION, {
        "model_type": "deepseek_v3", "hidden_size": 7168, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "num_attention_heads": 128}),
    "Qwen2-57B-A14B": (VALIDATION, {
        "model_type": "qwen2_moe", "hidden_size": 3584, "num_experts": 64, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2560, "num_attention_heads": 28}),
    "Qwen3-Next-80B-A3B": (VALIDATION, {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "num_attention_heads": 16}),
    "granite-3.1-3b-a800m": (VALIDATION, {
        "model_type": "granitemoe", "hidden_size": 1536, "num_local_experts": 40, "num_experts_per_tok": 8,
        "intermediate_size": 512, "num_attention_heads": 24}),
    "Llama-4-Scout": (VALIDATION, {
        "model_type": "llama4", "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "num_local_experts": 16, "num_experts_per_tok": 1,
            "intermediate_size": 8192, "num_attention_heads": 40}}),
    "ERNIE-4.5-21B-A3B": (VALIDATION, {
        "model_type": "ernie4_5_moe", "hidden_size": 2560, "moe_num_experts": 64, "moe_k": 6,
        "moe_intermediate_size": 1536, "num_attention_heads": 20}),
    # K=2880 takes no group of 128: a GPTQ export of it uses 32 (the set's one gs32 shape)
    "gpt-oss-20b": (VALIDATION, {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
        "intermediate_size": 2880, "num_attention_heads": 64, "quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}}),
}  # fmt: skip

SETS = (DEV, VALIDATION, "all")


def catalog_configs(which: str) -> list[tuple[str, dict]]:
    """(name, config) of the models of one set ("dev", "validation" or "all"), in catalog order."""
    if which not in SETS:
        raise ValueError(f"--catalog={which!r} is not one of {list(SETS)}")
    return [(name, cfg) for name, (split, cfg) in CATALOG.items() if which in ("all", split)]


def checkpoint_config(name: str, bits: int = 4, group_size: int = 128, layers: int = 1) -> dict:
    """A config.json for `name` that `vllm-wna16 doctor` and `tune` read (they read config.json alone): the
    catalog's fields, `layers` decoder layers and a GPTQ quantization_config (the catalog's own, if any)."""
    if name not in CATALOG:
        raise ValueError(f"{name!r} is not in the catalog; known: {', '.join(CATALOG)}")
    cfg = dict(CATALOG[name][1])
    quant = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": True, "desc_act": False}
    cfg.setdefault("quantization_config", quant)
    target = cfg.get("text_config", cfg)
    target["num_hidden_layers"] = layers
    return cfg


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description="write a catalog model's config.json (for doctor / tune) into DIR")
    ap.add_argument("name", choices=list(CATALOG))
    ap.add_argument("out", help="directory to write config.json into")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(checkpoint_config(args.name, args.bits, args.group_size), indent=1))
    print(out / "config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CATALOG", "DEV", "SETS", "VALIDATION", "catalog_configs", "checkpoint_config"]
