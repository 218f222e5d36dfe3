"""`vllm-wna16`: the plugin's command line (demo, doctor, make-checkpoint, tune).

Every verb reports errors the same way, here in `main` (one home): bad input or a bad
file is one line on stderr, `vllm-wna16 VERB: error: MESSAGE`, and no traceback.
The exit status follows grep's and diff's convention:

    0  success
    1  the command ran and its check failed (the demo's layers against float math)
    2  it could not run: a usage error (argparse), or an error (user_errors()): a missing,
       unreadable or corrupt file, a broken config.json, a checkpoint or value the plugin refuses

With VLLM_WNA16_DEBUG=1 (or true/yes/on) the error is raised with its traceback instead (0/false/no/off or
unset: one line; another value is itself an error). Any other exception is a bug and keeps its traceback.
A reader that stops early (`vllm-wna16 doctor DIR | head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2
DEBUG_ENV = "VLLM_WNA16_DEBUG"

EPILOG = (
    f"exit status: {EXIT_OK} success; {EXIT_CHECK_FAILED} the demo's check against float math failed; "
    f"{EXIT_ERROR} bad arguments or an error (missing, unreadable or corrupt file, broken config.json, "
    f"a checkpoint the plugin refuses), reported as one line on stderr. Set {DEBUG_ENV}=1 to see the "
    "traceback of an error instead."
)


def debug_on(environ=None) -> bool:
    """VLLM_WNA16_DEBUG: 1/true/yes/on show an error's traceback; unset, 0/false/no/off do not; anything else is a
    ValueError naming the variable (main reports it before the verb runs)."""
    raw = (os.environ if environ is None else environ).get(DEBUG_ENV, "")
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{DEBUG_ENV}={raw!r} is not understood; use 1 (show an error's traceback) or 0 (one line)")


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as the verbs' own errors: one line on stderr, exit 2 (module docstring)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input or a bad file, not a bug: reported as one line.

    OSError covers FileNotFoundError, PermissionError, IsADirectoryError, ...; ValueError covers
    the plugin's own errors and json.JSONDecodeError; safetensors raises SafetensorError for a
    truncated or garbled file.
    """
    errors: list[type[BaseException]] = [OSError, ValueError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # safetensors comes with torch's ecosystem, but the doctor needs none of it
        pass
    return tuple(errors)


def error_message(exc: BaseException) -> str:
    """One line for `exc`: its message with line breaks folded, and the file an OSError names."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        text = f"{where}: {exc.strerror}" if where is not None else exc.strerror
    else:
        text = str(exc)
    if type(exc).__name__ == "SafetensorError":
        text = f"safetensors: {text}"
    elif type(exc).__name__ == "JSONDecodeError":
        text = f"invalid JSON: {text}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__


# vLLM's and torch's import-time notes on a machine without a GPU driver ("Triton is installed but 0
# active driver(s)", "Failed to import from vllm._C", torch's "No CUDA runtime is found"): true, and not
# the user's concern in a tool that never starts vLLM's engine on a GPU.
NO_GPU_NOISE = ("vllm.triton_utils.importing", "vllm.platforms.interface", "torch.utils.cpp_extension")
# torch 2.14's deprecation notes about APIs vLLM 0.34 calls at import: vLLM's to act on, not the user's.
DEPRECATION_NOISE = ("torch._opaque_base", "torch._library.opaque_object")


def quiet_import_noise(verb: str) -> None:
    """doctor and make-checkpoint never run vLLM: only vLLM's and torch's errors are shown
    (VLLM_LOGGING_LEVEL too, unless the user set it: vLLM up to 0.30 configures its logger at import). The
    demo keeps vLLM's log (and the plugin's backend explanation, which is under `vllm.`), without the
    deprecation notes above, nor the no-GPU notes when it runs on CPU."""
    if verb in ("doctor", "make-checkpoint", "tune"):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        for name in ("vllm", "torch"):  # vLLM 0.31+ leaves `vllm` unconfigured here: it reaches the root handler
            logging.getLogger(name).setLevel(logging.ERROR)
        return
    import torch

    noise = DEPRECATION_NOISE + (() if torch.cuda.is_available() else NO_GPU_NOISE)
    for name in noise:
        logging.getLogger(name).setLevel(logging.ERROR)


def build_parser() -> argparse.ArgumentParser:
    from vllm_wna16_plugin import __version__
    from vllm_wna16_plugin.tools.demo import add_demo_args, run_demo
    from vllm_wna16_plugin.tools.doctor import add_doctor_args, run_doctor
    from vllm_wna16_plugin.tools.make_checkpoint import add_make_checkpoint_args, run_make_checkpoint
    from vllm_wna16_plugin.tools.tune import add_tune_args, run_tune

    parser = OneLineParser(
        prog="vllm-wna16",
        description="vllm-wna16-plugin tools: run the demo, plan a WNA16 MoE checkpoint, write a tiny one, or "
        "tune a checkpoint's MoE layers on this GPU.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"vllm-wna16-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = sub.add_parser(
        "demo",
        help="write a tiny GPTQ gs32 MoE checkpoint (K=2048) and run it: LLM(...) on a GPU, the MoE layers on CPU",
        description="Write a tiny checkpoint (default GPTQ int4, group size 32, hidden 2048: the shape that crashes "
        "vLLM 0.26's moe_wna16 CUDA path), print the plan, then generate with LLM(..., quantization="
        "'moe_wna16_plus') on a CUDA GPU, or, without one, run each MoE layer through the plugin on CPU and check "
        "it against float math. Offline: nothing is downloaded.",
        epilog=EPILOG,
    )
    add_demo_args(demo)
    demo.set_defaults(func=run_demo)
    doctor = sub.add_parser(
        "doctor",
        help="scheme, GEMM shapes, legal launch configs and backend choice of a checkpoint, from config.json",
        description="From config.json alone (no GPU): the scheme, each MoE GEMM per TP rank, the CUDA launch "
        "configs over batch sizes 1..4096 with their legality, and the backend auto would pick and why.",
        epilog=EPILOG,
    )
    add_doctor_args(doctor)
    doctor.set_defaults(func=run_doctor)
    make = sub.add_parser(
        "make-checkpoint",
        help="write a tiny random WNA16 MoE checkpoint (gptq, awq or compressed-tensors)",
        description="Quantize random float weights into a real HF-style checkpoint directory (config.json, "
        "safetensors, a local tokenizer) and keep the float weights beside it under reference/.",
        epilog=EPILOG,
    )
    add_make_checkpoint_args(make)
    make.set_defaults(func=run_make_checkpoint)
    tune = sub.add_parser(
        "tune",
        help="time the launch plan's candidates for a checkpoint's MoE layers on this GPU; keep the winners",
        description="On this machine's NVIDIA GPU: time the Triton configs and the cuda backend for each MoE "
        "scheme of the checkpoint (config.json only; random weights of its shapes) at each batch size, check "
        "each against float math, and write the winners to your own tuned tables (~/.cache/vllm-wna16-plugin/"
        "tuned, keyed by GPU, driver and plugin version), which later runs prefer to the shipped ones.",
        epilog=EPILOG,
    )
    add_tune_args(tune)
    tune.set_defaults(func=run_tune)
    parser.verbs = {"demo": demo, "doctor": doctor, "make-checkpoint": make, "tune": tune}
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb; returns the exit status (module docstring). Usage errors exit 2 from argparse."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the verb's own parser (the top-level one would report them under `vllm-wna16`)
        parser.verbs[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        debug = debug_on()  # read once, before the verb: a bad value is this command's error, not a traceback
    except ValueError as exc:
        print(f"vllm-wna16 {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.command == "demo":  # builds vLLM layers without a vLLM entry point: configure its logger as one would
            for name in DEPRECATION_NOISE:  # torch's notes while vLLM is imported to configure it
                logging.getLogger(name).setLevel(logging.ERROR)
            from vllm_wna16_plugin import _vllm

            _vllm.configure_logging()
        quiet_import_noise(args.command)  # after vLLM's dictConfig, which resets its child loggers' levels
        return int(args.func(args) or EXIT_OK)
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except user_errors() as exc:
        if debug:
            raise
        sys.stdout.flush()  # the verb's output so far comes first
        print(f"vllm-wna16 {args.command}: error: {error_message(exc)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
