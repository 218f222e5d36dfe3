"""`vllm-wna16 doctor MODEL_DIR`: the plan for a checkpoint, from config.json alone (no GPU, no vLLM needed).

Prints the parsed scheme, each MoE GEMM's shape per TP rank and the group size
it runs with, the CUDA launch configs over batch sizes 1..4096 with their
legality (and vLLM 0.26's own choice where vLLM is importable), and which
backend `auto` would pick on the named device, with every rejection's reason.
A bad config prints the same error loading would.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_wna16_plugin.backends import MoEProblem
from vllm_wna16_plugin.block_config import LEGAL_K_RATIOS, choose_cuda_block_config, cuda_group_size
from vllm_wna16_plugin.checkpoint_config import effective_group_size, parse_quantization_config
from vllm_wna16_plugin.oracle import collect_verdicts

DEVICES = {"sm70": ("cuda", 70), "sm80": ("cuda", 80), "sm90": ("cuda", 90), "sm100": ("cuda", 100),
           "xpu": ("xpu", None), "cpu": ("cpu", None)}  # fmt: skip
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def moe_dims(cfg: dict) -> dict[str, int]:
    """hidden, intermediate (per expert), experts, top_k of an HF config (text_config honoured)."""
    for c in (cfg, cfg.get("text_config") or {}):
        experts = next((c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)), None)
        if experts:
            inter = c.get("moe_intermediate_size") or c.get("intermediate_size")
            top_k = c.get("num_experts_per_tok") or c.get("top_k") or c.get("moe_topk")
            if inter and top_k and c.get("hidden_size"):
                return {"hidden": int(c["hidden_size"]), "intermediate": int(inter), "experts": int(experts),
                        "top_k": int(top_k)}  # fmt: skip
    raise ValueError("config.json has no MoE dimensions (hidden_size, moe_intermediate_size/intermediate_size, "
                     "num_experts/num_local_experts/n_routed_experts, num_experts_per_tok)")  # fmt: skip


def _vllm_block_k(num_tokens, top_k, experts, size_k, size_n, gs):
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_wna16_block_config
    except Exception:  # noqa: BLE001 - doctor runs without vLLM too
        return None
    cfg = get_moe_wna16_block_config(config={}, use_moe_wna16_cuda=True, num_valid_tokens=num_tokens * top_k,
                                     size_k=size_k, size_n=size_n, num_experts=experts, group_size=gs,
                                     real_top_k=top_k, block_size_m=min(16, num_tokens))  # fmt: skip
    return cfg["BLOCK_SIZE_K"]


def _launch_config_table(gemms, k: int, e: int, bits: int) -> list[str]:
    """CUDA launch configs over BATCH_SIZES per GEMM, with vLLM 0.26's BLOCK_SIZE_K and its legality."""
    out = ["", "CUDA WNA16 launch configs (BLOCK_SIZE_M/N/K), legal by construction; vLLM 0.26's BLOCK_SIZE_K beside:"]
    for name, size_k, size_n, gs in gemms:
        try:
            cgs = cuda_group_size(size_k, -1 if gs == size_k else gs)
        except ValueError as exc:
            out.append(f"  {name}: CUDA kernel cannot take it: {exc}")
            continue
        for m in BATCH_SIZES:
            c = choose_cuda_block_config(m, k, e, size_k, size_n, cgs, bits)
            theirs = _vllm_block_k(m, k, e, size_k, size_n, cgs)
            verdict = ""
            if theirs is not None and m * k / e > 6:  # vLLM's should_moe_wna16_use_cuda: Triton path here
                verdict = "  vLLM: Triton path"
            elif theirs is not None:
                legal = size_k % theirs == 0 and theirs % cgs == 0 and theirs // cgs in LEGAL_K_RATIOS
                verdict = f"  vLLM: BK={theirs}" + ("" if legal else f" ILLEGAL (ratio {theirs / cgs:g}) -> crash")
            out.append(f"  {name:8s} M={m:5d}: {c.block_size_m}/{c.block_size_n}/{c.block_size_k} ok{verdict}")
    return out


def _problem(scheme, dims: dict[str, int], i_loc: int, gs13: int, gs2: int, device: str) -> MoEProblem:
    platform, sm = DEVICES[device]
    return MoEProblem(scheme=scheme, hidden=dims["hidden"], intermediate=i_loc, num_experts=dims["experts"],
                      global_num_experts=dims["experts"], top_k=dims["top_k"], group_size_w13=gs13,
                      group_size_w2=gs2, act_dtype=torch.bfloat16, platform=platform, sm=sm,
                      has_g_idx=scheme.desc_act, extra={"plan_only": True})  # fmt: skip


def layer_problem(model_dir: str | Path, tp: int = 1, device: str = "sm90") -> MoEProblem:
    """The MoEProblem of the checkpoint's MoE layers on one TP rank of `device`, from config.json alone
    (extra["plan_only"]: backends judge the device named, not this machine)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    scheme = parse_quantization_config(cfg.get("quantization_config") or cfg.get("compression_config")).scheme
    dims = moe_dims(cfg)
    i_loc = dims["intermediate"] // tp
    gs13 = effective_group_size(scheme, dims["hidden"], layer="experts (gate/up, K=hidden)")
    gs2 = effective_group_size(scheme, i_loc, layer="experts (down, K=intermediate)", tp_size=tp,
                               full_size_k=dims["intermediate"])  # fmt: skip
    return _problem(scheme, dims, i_loc, gs13, gs2, device)


def plan(model_dir: str | Path, tp: int = 1, device: str = "sm90", launch_configs: bool = True) -> str:
    """The doctor's report as text. Raises ValueError for a bad config (the same error loading gives).

    launch_configs=False leaves out the CUDA launch-config table (the demo's short plan)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if quant is None:
        raise ValueError(f"{model_dir}/config.json has no quantization_config: not a quantized checkpoint")
    parsed = parse_quantization_config(quant)
    scheme = parsed.scheme
    dims = moe_dims(cfg)
    h, i, e, k = dims["hidden"], dims["intermediate"], dims["experts"], dims["top_k"]
    if i % tp:
        raise ValueError(f"intermediate size {i} does not split over TP={tp}")
    i_loc = i // tp
    gs13 = effective_group_size(scheme, h, layer="experts (gate/up, K=hidden)")
    gs2 = effective_group_size(scheme, i_loc, layer="experts (down, K=intermediate)", tp_size=tp, full_size_k=i)
    out = [f"checkpoint: {model_dir}", f"scheme: {scheme.describe()} (linear layers: vLLM's in-tree {parsed.quant_method})",
           f"MoE: E={e}, top_k={k}, H={h}, I={i}; TP={tp} -> I per rank {i_loc}", ""]  # fmt: skip
    out.append("GEMMs per rank:")
    gemms = [("gate/up", h, 2 * i_loc, gs13), ("down", i_loc, h, gs2)]
    for name, size_k, size_n, gs in gemms:
        regroup = "" if gs == scheme.group_size_for(size_k) or scheme.is_channelwise else " (re-grouped exactly)"
        out.append(f"  {name:8s} K={size_k:6d} N={size_n:6d} group={gs if gs != size_k else 'channel'}{regroup}")
    if launch_configs:
        out += _launch_config_table(gemms, k, e, scheme.bits)
    verdicts = collect_verdicts(_problem(scheme, dims, i_loc, gs13, gs2, device))
    chosen = next((v.backend for v in verdicts if v.ok), None)
    out += ["", f"backend on {device} (auto): {chosen}"]
    for v in verdicts:
        out.append(f"  - {v.backend}: {'ok' if v.ok else 'rejected: ' + v.reason}")
    return "\n".join(out)


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory with config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--device", choices=sorted(DEVICES), default="sm90", help="device to plan for (default sm90)")


def run_doctor(args) -> int:
    try:
        print(plan(args.model_dir, tp=args.tp, device=args.device))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}")
        return 2
    return 0
