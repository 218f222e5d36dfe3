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
Errors (a bad flag, a missing or corrupt file, a backend that cannot run) are raised
and reported by cli.main as one line; the exit status is 1 when a layer's check fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_wna16_plugin.backends import registry
from vllm_wna16_plugin.oracle import ENV_BACKEND, select_backend
from vllm_wna16_plugin.tools.doctor import DEVICES, layer_problem, plan, quantization_config_of
from vllm_wna16_plugin.tools.make_checkpoint import (
    ARCH_SPECS,
    FORMATS,
    MODEL_FILE,
    check_out_dir,
    load_config,
    load_reference,
    load_spec,
    open_safetensors,
    spec_from_args,
    write_checkpoint,
    write_config,
)

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = ("The capital of France is", "Water is made of hydrogen and", "1 2 3 4 5")
# The CPU check: the layer's output against float math on the same dequantized experts.
CPU_TOLERANCE = 2**-6  # max |error| / max |exact|: bf16 rounding of the activations, not of the weights


@dataclass(frozen=True)
class LayerCheck:
    """One MoE layer run on CPU: what ran it, how far from the float truth, how long."""

    prefix: str
    backend: str
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
    tiers = [key for key, d in DEVICES.items() if d.platform == "cuda" and d.sm <= sm]
    return max(tiers, key=lambda key: DEVICES[key].sm) if tiers else "cpu"


def _moe_tensors(path: Path, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """(name below `prefix`, tensor) of every stored tensor under prefix (one layer's experts)."""
    with open_safetensors(path / MODEL_FILE) as f:
        return [(k.removeprefix(prefix), f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)]


def _embedded_prompts(path: Path, prompts: list[str]) -> torch.Tensor:
    """The prompts' tokens, concatenated, through the checkpoint's embedding table: (T, H) bf16."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a missing or broken file
        raise ValueError(f"{path / 'tokenizer.json'}: cannot load the tokenizer ({exc})") from exc
    ids = [i for p in prompts for i in tokenizer.encode(p).ids]
    with open_safetensors(path / MODEL_FILE) as f:
        table = f.get_tensor("model.embed_tokens.weight")
    x = table[torch.tensor(ids)].float()
    # RMS-normalise as the layer's input norm would; the embedding's 0.02 scale is arbitrary.
    return (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).to(torch.bfloat16)


def run_moe_layers_on_cpu(path: str | Path, prompts: list[str]) -> Iterator[LayerCheck]:
    """Every MoE layer of a make_checkpoint checkpoint, through the plugin's method on CPU; yields each
    layer's check as soon as it is done (the demo prints progress from it).

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
    raw = quantization_config_of(path)
    reference = load_reference(path)
    x = _embedded_prompts(path, prompts)
    gate, up, down = arch.gate_up_down
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
            selection = layer.quant_method.selection
            yield LayerCheck(f"{block}.experts", selection.backend.name, selection.explain(), x.shape[0],
                             err.item(), seconds)  # fmt: skip


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
    where = p.add_mutually_exclusive_group()  # --out names where to write; --checkpoint writes nothing
    where.add_argument("--out", default=None, type=_directory,
                       help="checkpoint directory, kept (default: a temporary directory, removed at the end unless --keep)")  # fmt: skip
    where.add_argument("--checkpoint", default=None, type=_directory,
                       help="run an existing make-checkpoint directory instead of writing one (the shape flags are ignored)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the temporary checkpoint and print where it is")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="gptq")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=32, help="-1 = channel-wise (default 32)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size = the gate/up GEMM's K (default 2048)")
    p.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (default 256)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--backend", choices=("auto", *registry()), default="auto",
                   help=f"MoE backend; sets {ENV_BACKEND} for this run (default auto)")  # fmt: skip
    p.add_argument("--prompt", action="append", dest="prompts", type=_prompt, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=_positive, default=16, help="tokens generated per prompt (GPU run)")
    p.add_argument("--cpu", action="store_true", help="the CPU path even when a GPU is present")
    gpu = p.add_argument_group("GPU run")
    gpu.add_argument("--attention-backend", default=None, help="vLLM attention backend, e.g. TRITON_ATTN")
    gpu.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    gpu.add_argument("--gpu-memory-utilization", type=_fraction, default=0.3, help="in (0, 1] (default 0.3)")


def _directory(text: str) -> str:
    """argparse type: a non-empty path. An empty one (`--checkpoint "$UNSET"`) read as "not given" ran the default
    demo instead of the checkpoint asked for, and wrote a temporary checkpoint it then removed for `--out ''`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no directory; give one, or leave the flag out")
    return text


def _prompt(text: str) -> str:
    """argparse type: a prompt with at least one non-space character (the demo embeds its tokens)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty prompt has no tokens to run the layers on; give some text")
    return text


def _bounded(convert, what: str, ok, bound: str):
    """An argparse type: `convert(text)` (else "is not {what}") for which `ok(value)` holds (else "{bound}")."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} {bound}")
        return value

    return parse


_positive = _bounded(int, "an integer", lambda v: v >= 1, "must be at least 1")
_fraction = _bounded(
    float, "a number", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]: the share of GPU memory vLLM may use"
)


def check_backend(path: Path, device: str, backend: str) -> None:
    """Raise now if `--backend` cannot run this checkpoint on `device`: the oracle's check, named as typed.

    The engine (and the CPU run) read the choice from the environment variable the demo sets, so their
    own refusal would name that variable instead of the flag."""
    if backend != "auto":
        select_backend(layer_problem(path, device=device), backend, "--backend")


def preflight(spec, device: str, backend: str) -> str:
    """The plan text of the checkpoint `spec` would write, and the --backend check, from its config.json
    alone (written to a scratch directory): every flag is judged before anything is written."""
    scratch = Path(tempfile.mkdtemp(prefix="wna16-demo-plan-"))
    try:
        write_config(scratch, spec)
        check_backend(scratch, device, backend)
        return plan(scratch, device=device, launch_configs=False).replace(str(scratch), "(to be written)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_demo(args: argparse.Namespace) -> int:
    """The demo command: 0 when every check passed, 1 when a layer is off. Errors raise (cli.main reports them)."""
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    device = "cpu" if args.cpu else device_key()
    temporary = None
    if args.checkpoint:
        path = Path(args.checkpoint)
        load_config(path)  # a missing or broken config.json, named, before anything else reads it
        check_backend(path, device, args.backend)
        print(plan(path, device=device, launch_configs=False))
    else:
        spec = spec_from_args(args, sym=True)  # a bad shape flag is named as typed
        print(preflight(spec, device, args.backend))
        if args.out:
            check_out_dir(args.out, force=False)  # never into another model's directory
        path = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="wna16-demo-"))
        temporary = None if args.out else path
        print(flush=True)  # the plan before make-checkpoint's progress lines (stderr)
        try:
            write_checkpoint(path, spec)
        except BaseException:
            if temporary is not None:  # a failed write leaves nothing behind
                shutil.rmtree(temporary, ignore_errors=True)
            raise
    if args.backend != "auto":
        os.environ[ENV_BACKEND] = args.backend  # read by the oracle, in the engine's processes too
    try:
        status = _generate(path, prompts, args) if device != "cpu" else _check_layers_on_cpu(path, prompts, args)
    finally:
        if temporary is not None and not args.keep:
            shutil.rmtree(temporary, ignore_errors=True)
            print(f"removed the temporary checkpoint {temporary} (--keep keeps it)")
        elif temporary is not None:
            print(f"checkpoint kept at {temporary}")
    return status


def _generate(path: Path, prompts: list[str], args: argparse.Namespace) -> int:
    print(f"\nGPU: {torch.cuda.get_device_name()}; running LLM(model={str(path)!r}, quantization='moe_wna16_plus')")
    texts = generate_on_gpu(path, prompts, args)
    for prompt, text in zip(prompts, texts, strict=True):
        print(f"  {prompt!r} -> {text!r}")
    done = sum(bool(t) for t in texts)
    print(f"\n{done}/{len(prompts)} prompts generated text with quantization='moe_wna16_plus': "
          f"{'OK' if done == len(prompts) else 'FAILED'}")  # fmt: skip
    return 0 if done == len(prompts) else 1


def _check_layers_on_cpu(path: Path, prompts: list[str], args: argparse.Namespace) -> int:
    why = "--cpu given" if args.cpu else "no CUDA GPU found"
    spec = load_spec(path)
    print(f"\n{why}: vLLM cannot generate here, so the plugin's MoE layers run on CPU instead:")
    print("vLLM's FusedMoE layer and weight loader, the backend the oracle picks, the checkpoint's router,")
    print(f"on the {len(prompts)} prompts' token embeddings; checked against float math on the dequantized experts.")
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.WARNING)  # vLLM's set-up notes; the plan above already gave the backend
    checks = []
    try:
        for i, c in enumerate(run_moe_layers_on_cpu(path, prompts), 1):
            status = "ok" if c.ok else f"FAILED (tolerance {CPU_TOLERANCE:.3g})"
            print(f"  layer {i}/{spec.layers} {c.prefix}: backend {c.backend!r}, {c.tokens} tokens, "
                  f"{c.seconds * 1e3:.1f} ms, max error {c.max_rel_error:.2e} of the output's max: {status}",
                  flush=True)  # fmt: skip
            checks.append(c)
    finally:
        vllm_logger.setLevel(level)
    passed = sum(c.ok for c in checks)
    print(
        f"\n{passed}/{len(checks)} MoE layers match the float reference: {'OK' if passed == len(checks) else 'FAILED'}"
    )
    return 0 if passed == len(checks) else 1
