"""`vllm-wna16 demo`: a user's whole path on one tiny checkpoint, offline.

1. Writes a tiny random checkpoint through make_checkpoint. The default is GPTQ int4,
   group size 32, Qwen3-MoE style, hidden 2048. The MoE's gate/up GEMM then has K=2048,
   where vLLM 0.26's own moe_wna16 CUDA path picks BLOCK_SIZE_K=512 and crashes.
2. Prints the plan: the scheme, the GEMMs, and the backend `auto` picks on this device,
   with every rejection's reason (the doctor's report without the launch-config table).
3. With a CUDA GPU: `LLM(model=..., quantization="moe_wna16_plus")`, greedy generation.
   Prints the texts and the times. The engine logs the backend of each MoE layer type
   and the reasons.
   Without one: says so, then runs every MoE layer of the checkpoint through the plugin's
   method on CPU: vLLM's FusedMoE layer and weight loader, the backend the oracle picks,
   the router of the checkpoint. The input is the prompts' token embeddings. Each layer
   is checked against float math on the checkpoint's dequantized experts.

No network and no model hub: the checkpoint and its tokenizer are written locally.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_wna16_plugin.oracle import ENV_BACKEND
from vllm_wna16_plugin.tools.doctor import DEVICES, plan
from vllm_wna16_plugin.tools.make_checkpoint import (
    ARCH_SPECS,
    FORMATS,
    MODEL_FILE,
    load_reference,
    load_spec,
    make_checkpoint,
)

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("The capital of France is", "Water is made of hydrogen and", "1 2 3 4 5")
BACKENDS = ("auto", "triton", "cuda", "marlin", "vllm_cuda", "reference")
# The CPU check: the layer's output against float math on the same dequantized experts.
CPU_TOLERANCE = 2**-6  # max |error| / max |exact|: bf16 rounding of the activations, not of the weights


@dataclass(frozen=True)
class LayerCheck:
    """One MoE layer run on CPU: what ran it, how far from the float truth, how long."""

    prefix: str
    explanation: str  # the oracle's Selection.explain()
    tokens: int
    max_rel_error: float  # max |out - exact| / max |exact|
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_rel_error <= CPU_TOLERANCE


def device_key() -> str:
    """The doctor's --device for this machine: the newest sm tier at or below the GPU's, or cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    tiers = [key for key, (platform, tier) in DEVICES.items() if platform == "cuda" and tier <= sm]
    return max(tiers, key=lambda key: DEVICES[key][1]) if tiers else "cpu"


def _moe_tensors(path: Path, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """(name below `prefix`, tensor) of every stored tensor under prefix (one layer's experts)."""
    from safetensors import safe_open

    with safe_open(str(path / MODEL_FILE), "pt") as f:
        return [(k.removeprefix(prefix), f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)]


def _embedded_prompts(path: Path, prompts: list[str]) -> torch.Tensor:
    """The prompts' tokens, concatenated, through the checkpoint's embedding table: (T, H) bf16."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = [i for p in prompts for i in tokenizer.encode(p).ids]
    with safe_open(str(path / MODEL_FILE), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    x = table[torch.tensor(ids)].float()
    # RMS-normalise as the layer's input norm would; the embedding's 0.02 scale is arbitrary.
    return (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(torch.bfloat16)


def run_moe_layers_on_cpu(path: str | Path, prompts: list[str]) -> list[LayerCheck]:
    """Every MoE layer of a make_checkpoint checkpoint, through the plugin's method on CPU.

    The backend comes from the oracle as in serving (VLLM_WNA16_PLUS_BACKEND honoured). Each
    layer's output is compared with fused_moe_ref on the checkpoint's float32 dequantized
    experts (reference/ beside it), for the same routing.
    """
    from vllm_wna16_plugin import _vllm, register
    from vllm_wna16_plugin.reference import fused_moe_ref

    path = Path(path)
    register()
    spec = load_spec(path)
    arch = ARCH_SPECS[spec.arch]
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    reference = load_reference(path)
    x = _embedded_prompts(path, prompts)
    gate, up, down = arch.gate_up_down
    checks = []
    with _vllm.cpu_layer_context() as vllm_cfg:
        quant_config = _vllm.quantization_config_cls("moe_wna16_plus").from_config(raw)
        for li in range(spec.layers):
            block = f"model.layers.{li}.{arch.moe_block}"
            layer = _vllm.build_routed_experts(
                vllm_cfg, quant_config, num_experts=spec.experts, top_k=spec.top_k, hidden=spec.hidden,
                intermediate=spec.intermediate, prefix=f"{block}.experts", ckpt_names=(gate, down, up),
            )  # fmt: skip
            # vLLM's load_weights is a generator: consuming it is what loads
            for _ in layer.load_weights(_moe_tensors(path, f"{block}.experts.")):
                pass
            layer.quant_method.process_weights_after_loading(layer)
            router = dict(_moe_tensors(path, f"{block}.gate."))["weight"].float()
            probs = (x.float() @ router.T).softmax(-1)
            topk_weights, topk_ids = probs.topk(spec.top_k, dim=-1)
            topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)  # both archs renormalise
            t0 = time.perf_counter()
            out = layer.quant_method.apply(layer, x, topk_weights, topk_ids, None, None)
            seconds = time.perf_counter() - t0
            exact = fused_moe_ref(
                x, reference[f"layers.{li}.w13"], reference[f"layers.{li}.w2"], topk_weights, topk_ids
            )
            err = (out.float() - exact.float()).abs().max() / exact.float().abs().max()
            checks.append(LayerCheck(f"{block}.experts", layer.quant_method.selection.explain(), x.shape[0],
                                     err.item(), seconds))  # fmt: skip
    return checks


def generate_on_gpu(path: Path, prompts: list[str], args: argparse.Namespace) -> list[str]:
    """LLM(..., quantization="moe_wna16_plus") on the checkpoint, greedy; returns the texts."""
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=str(path),
        tokenizer=str(path),
        quantization="moe_wna16_plus",
        max_model_len=256,
        max_num_seqs=max(8, len(prompts)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    t2 = time.perf_counter()
    texts = [r.outputs[0].text for r in results]
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    print(f"\nLLM start-up {t1 - t0:.1f}s; generation {t2 - t1:.2f}s, {tokens} tokens ({tokens / (t2 - t1):.0f} tok/s)")
    return texts


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="checkpoint directory (default: a new temporary directory)")
    p.add_argument("--checkpoint", default=None,
                   help="run an existing make-checkpoint directory instead of writing one (the shape flags are ignored)")  # fmt: skip
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="gptq")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=32, help="-1 = channel-wise (default 32)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size = the gate/up GEMM's K (default 2048)")
    p.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (default 256)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help=f"MoE backend; sets {ENV_BACKEND} for this run (default auto)")  # fmt: skip
    p.add_argument("--prompt", action="append", dest="prompts", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--cpu", action="store_true", help="the CPU path even when a GPU is present")
    gpu = p.add_argument_group("GPU run")
    gpu.add_argument("--attention-backend", default=None, help="vLLM attention backend, e.g. TRITON_ATTN")
    gpu.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    gpu.add_argument("--gpu-memory-utilization", type=float, default=0.3)


def run_demo(args: argparse.Namespace) -> int:
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    if args.backend != "auto":
        os.environ[ENV_BACKEND] = args.backend  # read by the oracle, in the engine's processes too
    try:
        if args.checkpoint:
            path = Path(args.checkpoint)
        else:
            out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="wna16-demo-"))
            path = make_checkpoint(out, fmt=args.fmt, bits=args.bits, group_size=args.group_size, hidden=args.hidden,
                                   intermediate=args.intermediate, experts=args.experts, top_k=args.top_k,
                                   layers=args.layers, sym=True)  # fmt: skip
        device = "cpu" if args.cpu else device_key()
        print(plan(path, device=device, launch_configs=False))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}")
        return 2
    if device != "cpu":
        print(f"\nGPU: {torch.cuda.get_device_name()}; running LLM(model={str(path)!r}, quantization='moe_wna16_plus')")
        texts = generate_on_gpu(path, prompts, args)
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"  {prompt!r} -> {text!r}")
        return 0
    why = "--cpu given" if args.cpu else "no CUDA GPU found"
    print(f"\n{why}: vLLM cannot generate here, so the plugin's MoE layers run on CPU instead:")
    print("vLLM's FusedMoE layer and weight loader, the backend the oracle picks, the checkpoint's router,")
    print(f"on the {len(prompts)} prompts' token embeddings; checked against float math on the dequantized experts.")
    try:
        checks = run_moe_layers_on_cpu(path, prompts)
    except (ValueError, FileNotFoundError) as exc:  # the plugin's load-time errors: a message, not a trace
        print(f"error: {exc}")
        return 2
    for c in checks:
        status = "ok" if c.ok else f"FAILED (tolerance {CPU_TOLERANCE:.3g})"
        print(f"\n{c.prefix}: {c.explanation}")
        print(
            f"  {c.tokens} tokens, {c.seconds * 1e3:.1f} ms, max error {c.max_rel_error:.2e} of the output's max: {status}"
        )
    return 0 if all(c.ok for c in checks) else 1
