"""`vllm-wna16`: the plugin's command line (demo, doctor, make-checkpoint)."""

from __future__ import annotations

import argparse
import logging


def build_parser() -> argparse.ArgumentParser:
    from vllm_wna16_plugin import __version__
    from vllm_wna16_plugin.tools.demo import add_demo_args, run_demo
    from vllm_wna16_plugin.tools.doctor import add_doctor_args, run_doctor
    from vllm_wna16_plugin.tools.make_checkpoint import add_make_checkpoint_args, run_make_checkpoint

    parser = argparse.ArgumentParser(
        prog="vllm-wna16",
        description="vllm-wna16-plugin tools: run the demo, plan a WNA16 MoE checkpoint, or write a tiny one.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-wna16-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="write a tiny GPTQ gs32 MoE checkpoint (K=2048) and run it: LLM(...) on a GPU, the MoE layers on CPU",
        description="Write a tiny checkpoint (default GPTQ int4, group size 32, hidden 2048: the shape that crashes "
        "vLLM 0.26's moe_wna16 CUDA path), print the plan, then generate with LLM(..., quantization="
        "'moe_wna16_plus') on a CUDA GPU, or, without one, run each MoE layer through the plugin on CPU and check "
        "it against float math. Offline: nothing is downloaded.",
    )
    add_demo_args(demo)
    demo.set_defaults(func=run_demo)
    doctor = sub.add_parser(
        "doctor",
        help="scheme, GEMM shapes, legal launch configs and backend choice of a checkpoint, from config.json",
        description="From config.json alone (no GPU): the scheme, each MoE GEMM per TP rank, the CUDA launch "
        "configs over batch sizes 1..4096 with their legality, and the backend auto would pick and why.",
    )
    add_doctor_args(doctor)
    doctor.set_defaults(func=run_doctor)
    make = sub.add_parser(
        "make-checkpoint",
        help="write a tiny random WNA16 MoE checkpoint (gptq, awq or compressed-tensors)",
        description="Quantize random float weights into a real HF-style checkpoint directory (config.json, "
        "safetensors, a local tokenizer) and keep the float weights beside it under reference/.",
    )
    add_make_checkpoint_args(make)
    make.set_defaults(func=run_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "demo":  # builds vLLM layers without a vLLM entry point: configure vLLM's logger as one would
        from vllm_wna16_plugin import _vllm

        _vllm.configure_logging()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
