"""Offline end-to-end throughput on the GPU: the plugin vs vLLM's own WNA16 MoE paths, one checkpoint.

The checkpoint is written by make_checkpoint with real MoE dimensions, without its float reference (nothing here
reads it; that leaves room for layers under make_checkpoint's size cap). The default is Qwen3-30B-A3B's MoE
(E=128, top_k=8, H=2048, I=768), GPTQ int4 gs128, 12 layers (about 3.6 GB: the MoE's share of a step grows with
the layers, vLLM's per-step work does not), random weights. Every provider runs the same workloads in its own process (one LLM per process), with CUDA
graphs, greedy, ignore_eos; each workload runs once untimed (first-use compiles), then REPEATS
times, and the table shows the median:

  decode-bs{1,8,64}  B prompts of 32 random tokens, 128 output tokens each: output tokens/s
  prefill            64 prompts of 512 random tokens, 1 output token each: input tokens/s

Providers: plugin-auto (quantization=moe_wna16_plus), plugin-triton (--moe-backend triton),
vllm-moe_wna16 (vLLM's in-tree moe_wna16), vllm-default (vLLM's own method for the format, with its
own MoE backend choice: Marlin on vLLM 0.26; Humming, then Marlin, on sm90 with vLLM 0.34),
vllm-marlin and vllm-humming (vLLM's own method with --moe-backend forced; not in the default list).
A provider that fails shows its error in the table.

    python bench/e2e.py --out bench/results/h200 [--layers 12] [--providers ...] [--group-size 128]

A checkpoint of many layers takes minutes to write (24 layers: about 7 GB, under make_checkpoint's 8 GiB cap;
Qwen3-30B-A3B has 48): --checkpoint DIR writes it there once and reuses it while DIR holds one of the same spec (a
warm GPU machine keeps /tmp between calls). Each run on it saves its providers' results in DIR/e2e-runs.json, and
the table shows every provider timed there (the latest run of each), so the providers can be split over calls:

    python bench/e2e.py --layers 24 --checkpoint /tmp/e2e-24 --providers plugin-auto     # call 1
    python bench/e2e.py --layers 24 --checkpoint /tmp/e2e-24 --providers vllm-default    # call 2, warm: both rows

--include names another run's .json on the same checkpoint spec whose providers join the table.

Writes <out>/e2e-<date>-<commit>.md and .json and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_moe import git_commit  # noqa: E402 - bench/ is the script's directory

PROVIDERS = {
    "plugin-auto": dict(quantization="moe_wna16_plus", moe_backend="auto"),
    "plugin-triton": dict(quantization="moe_wna16_plus", moe_backend="triton"),
    "vllm-moe_wna16": dict(quantization="moe_wna16", moe_backend="auto"),
    "vllm-default": dict(quantization=None, moe_backend="auto"),
}
OPTIONAL_PROVIDERS = {
    "vllm-marlin": dict(quantization=None, moe_backend="marlin"),
    "vllm-humming": dict(quantization=None, moe_backend="humming"),  # vLLM 0.33-0.34's default on sm90
}
# Without --torch-compile: no torch.compile (start-up in seconds, not minutes, so that the four
# providers fit one GPU call), full CUDA graphs of every decode batch the workloads reach.
EAGER_COMPILE_GRAPHS = {
    "mode": 0,
    "cudagraph_mode": "FULL_DECODE_ONLY",
    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
}
WORKLOADS = [  # (name, prompts, prompt tokens, output tokens)
    ("decode-bs1", 1, 32, 128),
    ("decode-bs8", 8, 32, 128),
    ("decode-bs64", 64, 32, 128),
    ("prefill", 64, 512, 1),
]
REPEATS = 5  # timed passes per workload after an untimed one; the table shows the median


def profiled_pass(llm, prompts, sampling_params, workload: str, cpu: bool = False, top: int = 10) -> dict:
    """One pass of a workload under torch.profiler: its wall time, the device time of all its kernels (the
    difference is time the GPU waited on the host), the top kernels by device time and, with `cpu`, the top host
    ops by self time (the engine runs in this process; CUPTI records the kernels of CUDA-graph replays too). A
    decode workload's pass includes its prompts' prefill (B x 32 tokens)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _, n, plen, olen = next(w for w in WORKLOADS if w[0] == workload)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        llm.generate(prompts(n, plen), sampling_params(max_tokens=olen, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # the kernels only: with CPU activity each op that launches a kernel also carries the kernel's time as its own
    rows = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0),
                  key=lambda e: -e.self_device_time_total)  # fmt: skip
    total = sum(e.self_device_time_total for e in rows)
    result = {"wall_ms": wall * 1e3, "kernel_ms": total / 1e3,
              "kernels": [{"kernel": e.key[:90], "calls": e.count, "ms": e.self_device_time_total / 1e3,
                           "share": e.self_device_time_total / total} for e in rows[:top]]}  # fmt: skip
    if cpu:
        host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
        result["host_ops"] = [{"op": e.key[:90], "calls": e.count, "ms": e.self_cpu_time_total / 1e3}
                              for e in host[:top]]  # fmt: skip
    return result


def worker(spec_path: str, out_path: str) -> int:
    """One provider: LLM once; each workload once untimed, then REPEATS timed passes (median); JSON out."""
    import random

    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    result = {"provider": spec["provider"], "workloads": {}}
    try:
        t0 = time.perf_counter()
        compilation = None if spec.get("torch_compile") else EAGER_COMPILE_GRAPHS
        llm = LLM(model=spec["model"], tokenizer=spec["model"], quantization=spec["quantization"],
                  moe_backend=spec["moe_backend"], max_model_len=1024, max_num_seqs=64,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.5,
                  attention_backend=spec.get("attention_backend") or None,
                  compilation_config=compilation)  # fmt: skip
        result["startup_s"] = time.perf_counter() - t0
        rng = random.Random(0)
        vocab = spec["vocab"]

        def prompts(n, length):
            return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]

        for name, n, plen, olen in WORKLOADS:
            params = SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True)
            # one untimed pass first: a prefill of n x plen tokens is a batch size the start-up did not
            # run, and Triton compiles a kernel for its launch config on first use (c5ff782's table paid
            # that compile inside the first provider's decode-bs8)
            llm.generate(prompts(n, plen), params, use_tqdm=False)
            seconds = []
            for _ in range(spec.get("repeats", REPEATS)):
                batch = prompts(n, plen)
                t = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                seconds.append(time.perf_counter() - t)
            dt = statistics.median(seconds)
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            result["workloads"][name] = {"seconds": dt, "all_seconds": seconds, "output_tok_s": generated / dt,
                                         "input_tok_s": n * plen / dt}  # fmt: skip
        for workload in spec.get("profile", []):
            result.setdefault("profiles", {})[workload] = profiled_pass(llm, prompts, SamplingParams, workload,
                                                                        cpu=spec.get("profile_cpu", False))  # fmt: skip
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - a provider that fails is a result
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"
    Path(out_path).write_text(json.dumps(result))
    return 0


def device_name() -> str:
    """The first GPU's name, read without creating a CUDA context in this process (its workers need the memory)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return out.stdout.strip() or "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


SAVED_RUNS = "e2e-runs.json"  # in a --checkpoint directory: the providers timed on it so far


def describe_checkpoint(spec: dict) -> str:
    """One line naming a checkpoint's spec: what --include compares (the same checkpoint, or not comparable)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(spec.items()))


def reusable(ckpt: Path, wanted: dict, load_spec, spec_type) -> bool:
    """Whether `ckpt` holds a make_checkpoint checkpoint of the spec `wanted` (every field of spec_type(**wanted),
    defaults included, equal); a directory of another spec is an error (nothing is overwritten), an empty or missing
    one is written."""
    if not (ckpt / "config.json").exists():
        return False
    spec, full = dataclasses.asdict(load_spec(ckpt)), dataclasses.asdict(spec_type(**wanted))
    differ = {k: (spec.get(k), v) for k, v in full.items() if spec.get(k) != v}
    if differ:
        raise SystemExit(f"--checkpoint={ckpt} holds another checkpoint ({', '.join(f'{k}: {a} there, {b} wanted' for k, (a, b) in differ.items())}): "
                         "name an empty directory")  # fmt: skip
    return True


def read_included(path: Path, described: str, setting: str) -> list[dict]:
    """The provider results of an earlier run's .json; refused unless they were measured on this run's checkpoint
    spec and setting (device, vLLM, torch, attention backend, compilation, repeats)."""
    rows = json.loads(path.read_text())
    other = {r.get("checkpoint") for r in rows} - {described}
    if other:
        raise SystemExit(
            f"--include={path}: measured on {sorted(map(str, other))}, not this run's checkpoint ({described})"
        )
    other = {r.get("setting") for r in rows} - {setting}
    if other:
        raise SystemExit(
            f"--include={path}: measured with {sorted(map(str, other))}, not this run's setting ({setting})"
        )
    return rows


def merged(earlier: list[dict], mine: list[dict]) -> list[dict]:
    """One row per provider: this run's, else the last earlier one; a failed row never replaces a good one."""
    rows: dict[str, dict] = {}
    for r in [*earlier, *mine]:
        kept = rows.get(r["provider"])
        if kept is None or r.get("ok") or not kept.get("ok"):
            rows[r["provider"]] = r
    return list(rows.values())


def render(results: list[dict], header: str) -> str:
    names = [w[0] for w in WORKLOADS]
    lines = [header, "", "| provider | start-up s | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['provider']} | failed: {r.get('error', '?')} |" + " |" * len(names))
            continue
        cells = []
        for name in names:
            w = r["workloads"][name]
            cells.append(f"{w['input_tok_s']:.0f} in tok/s" if name == "prefill" else f"{w['output_tok_s']:.0f} tok/s")
        lines.append(f"| {r['provider']} | {r['startup_s']:.0f} | " + " | ".join(cells) + " |")
    base = next((r for r in results if r["provider"] == "plugin-auto" and r.get("ok")), None)
    if base:
        lines += ["", "plugin-auto relative to each provider (>1: the plugin is faster):", ""]
        lines += ["| vs | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for r in results:
            if r is base or not r.get("ok"):
                continue
            key = lambda name: "input_tok_s" if name == "prefill" else "output_tok_s"  # noqa: E731
            ratios = [base["workloads"][n][key(n)] / r["workloads"][n][key(n)] for n in names]
            lines.append(f"| {r['provider']} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    for r in results:
        for workload, prof in r.get("profiles", {}).items():
            lines += ["", f"{r['provider']}: one {workload} pass under torch.profiler: {prof['wall_ms']:.0f} ms wall, "
                      f"{prof['kernel_ms']:.0f} ms of kernels (the GPU waited {prof['wall_ms'] - prof['kernel_ms']:.0f} ms "
                      "on the host, or more where kernels overlap); its top kernels:", "",
                      "| kernel | calls | ms | share |", "|---|---|---|---|"]  # fmt: skip
            lines += [f"| `{k['kernel']}` | {k['calls']} | {k['ms']:.2f} | {k['share']:.0%} |" for k in prof["kernels"]]
            if prof.get("host_ops"):
                lines += ["", "its top host ops (self time):", "", "| op | calls | ms |", "|---|---|---|"]
                lines += [f"| `{o['op']}` | {o['calls']} | {o['ms']:.2f} |" for o in prof["host_ops"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200"))
    ap.add_argument(
        "--providers",
        default=",".join(PROVIDERS),
        help=f"comma-separated, of {list(PROVIDERS) + list(OPTIONAL_PROVIDERS)}",
    )
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--format", dest="fmt", default="gptq", choices=("gptq", "awq", "compressed-tensors"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--attention-backend", default="TRITON_ATTN", help="'' = vLLM's choice")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per provider")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed passes per workload (median)")
    ap.add_argument("--profile", default="", metavar="WORKLOADS",
                    help=f"after the timed passes, one pass of each of these workloads (comma-separated, of "
                         f"{[w[0] for w in WORKLOADS]}) under torch.profiler: its top kernels per provider")  # fmt: skip
    ap.add_argument("--profile-prefill", action="store_true", help="the same as --profile prefill")
    ap.add_argument("--profile-cpu", action="store_true", help="--profile records the host's ops too (slower pass)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="write the checkpoint into DIR, or reuse the one DIR holds when its spec is this run's")  # fmt: skip
    ap.add_argument("--include", action="append", default=[], metavar="JSON",
                    help="an earlier run's .json on the same checkpoint: its providers join the table (repeatable)")  # fmt: skip
    ap.add_argument("--torch-compile", action="store_true", help="vLLM's default compilation (slow start-up)")
    ap.add_argument("--quantize-attention", action="store_true",
                    help="quantize attention too (vLLM 0.26's in-tree moe_wna16 failed at load on such a GPTQ "
                         "checkpoint: bench/results/h200/2026-12-03-11bb0e4-e2e-record.jsonl)")  # fmt: skip
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    profile = [w for w in args.profile.split(",") if w] + (["prefill"] if args.profile_prefill else [])
    unknown = sorted(set(profile) - {w[0] for w in WORKLOADS})
    if unknown:
        ap.error(f"--profile={args.profile!r}: {unknown} not among the workloads {[w[0] for w in WORKLOADS]}")

    import torch

    from vllm_wna16_plugin.tools.make_checkpoint import CheckpointSpec, load_spec, make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="wna16-e2e-"))
    wanted = dict(fmt=args.fmt, bits=4, group_size=args.group_size, hidden=args.hidden, intermediate=args.intermediate,
                  experts=args.experts, top_k=args.top_k, layers=args.layers,
                  quantize_attention=args.quantize_attention, float_reference=False)  # fmt: skip
    ckpt = Path(args.checkpoint) if args.checkpoint else work / "ck"
    if reusable(ckpt, wanted, load_spec, CheckpointSpec):
        print(f"checkpoint reused: {ckpt}", flush=True)
    else:
        t0 = time.perf_counter()
        ckpt = make_checkpoint(ckpt, **wanted)
        print(f"checkpoint written in {time.perf_counter() - t0:.0f}s: {ckpt}", flush=True)
    import vllm

    described = describe_checkpoint(wanted)
    setting = (f"{device_name()}, vLLM {vllm.__version__}, torch {torch.__version__}, attention "
               f"{args.attention_backend or 'auto'}, torch.compile {args.torch_compile}, {args.repeats} repeats")  # fmt: skip
    saved = ckpt / SAVED_RUNS
    kept = read_included(saved, described, setting) if saved.exists() else []  # timed on this checkpoint before
    included = [r for path in args.include for r in read_included(Path(path), described, setting)]
    vocab = load_spec(ckpt).resolved_vocab_size
    results = []
    for prov in args.providers.split(","):
        spec = dict({**PROVIDERS, **OPTIONAL_PROVIDERS}[prov], provider=prov, model=str(ckpt), vocab=vocab,
                    attention_backend=args.attention_backend, torch_compile=args.torch_compile,
                    repeats=args.repeats, profile=list(dict.fromkeys(profile)),
                    profile_cpu=args.profile_cpu)  # fmt: skip
        spec_path, out_path = work / f"{prov}.spec.json", work / f"{prov}.out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, TRITON_INTERPRET="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.pop("VLLM_WNA16_PLUS_BACKEND", None)
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", str(spec_path), str(out_path)], env=env,
                                  capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
            r = (
                json.loads(out_path.read_text())
                if out_path.exists()
                else {
                    "provider": prov,
                    "ok": False,
                    "error": f"worker died (rc {proc.returncode}): {proc.stderr[-300:]}",
                }
            )
        except subprocess.TimeoutExpired:
            r = {"provider": prov, "ok": False, "error": f"timed out after {args.timeout}s"}
        r.update(checkpoint=described, setting=setting, commit=git_commit())
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.checkpoint:  # after each provider: a call cut short keeps what it timed
            saved.write_text(json.dumps(merged(kept, results), indent=1))
    results = merged([*included, *kept], results)

    commits = sorted({r.get("commit") for r in results if r.get("commit") and r.get("commit") != git_commit()})
    header = (
        f"# End-to-end offline throughput\n\n{datetime.date.today()} · {torch.cuda.get_device_name()} · "
        f"vLLM {vllm.__version__} · torch {torch.__version__} · commit {git_commit()}\n\n"
        f"Checkpoint: make_checkpoint {args.fmt} int4 gs{args.group_size}, E={args.experts}, top_k={args.top_k}, "
        f"H={args.hidden}, I={args.intermediate}, {args.layers} layers, random weights, attention "
        f"{'int4' if args.quantize_attention else 'bf16'}. Greedy, ignore_eos, "
        f"{'torch.compile + CUDA graphs' if args.torch_compile else 'no torch.compile, full CUDA graphs for decode'}; "
        f"decode: B prompts x 32 tokens -> 128 tokens; prefill: 64 x 512 tokens -> 1. Each workload once "
        f"untimed, then the median of {args.repeats} timed passes."
        + (f" Rows timed at other commits on the same checkpoint and setting: {', '.join(commits)} "
           f"({', '.join(r['provider'] + ': ' + r['commit'] for r in results if r.get('commit') in commits)})."
           if commits else "")
    )  # fmt: skip
    table = render(results, header)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = f"e2e-{datetime.date.today()}-{git_commit()}"
    (out / f"{stamp}.md").write_text(table)
    (out / f"{stamp}.json").write_text(json.dumps(results, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
