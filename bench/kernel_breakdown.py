"""Where a MoE layer call's time goes (GPU): the device time of each kernel of a provider's layer call,
next to the call's CUDA-graph time, for the plugin's backends and vLLM's Marlin side by side.

    python bench/kernel_breakdown.py --shapes deepseek-v2-lite,mixtral-8x7b --m 2,8 \\
        --providers plugin-cuda,vllm-marlin --out bench/results/h200
    python bench/kernel_breakdown.py --shapes mixtral-8x7b --m 2,4 --providers plugin-cuda,plugin-cuda-ao  # act order

The question it answers: when a layer is slower than Marlin's, is it one of the GEMMs (and which), the
alignment and top-k sum around them, or the gaps between the kernels (graph time - kernel time)?
Kernel times come from torch.profiler (CUPTI) over eager calls on rotating weight copies (L2-cold, as
bench_moe.py's graphs), medians over the calls; the graph time is bench_moe.time_graph's median.
Writes <out>/<date>-<commit>-breakdown.md and prints it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import math
import re
from pathlib import Path

import torch
from bench_moe import (  # bench/ is on sys.path as the script's folder
    ACT_ORDER_SUFFIX,
    ROOT,
    SHAPES,
    Weights,
    git_commit,
    make_act_order,
    make_weights,
    plugin_backend,
    time_graph,
    weight_bytes_per_expert,
)
from torch.profiler import ProfilerActivity, profile

from vllm_wna16_plugin import packing


def short_name(kernel: str) -> str:
    """A kernel's name without its namespaces, template arguments and parameters (Marlin's and ours are long)."""
    name = re.sub(r"\(anonymous namespace\)::", "", kernel).removeprefix("void ")
    return name.split("<")[0].split("(")[0].split("::")[-1][:48]


def kernel_times(fn_list, calls: int) -> dict[str, float]:
    """Mean device µs per layer call of each kernel name, over `calls` calls cycling through fn_list."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn_list[i % len(fn_list)]()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per_call = len(events) // calls if len(events) % calls == 0 else 0
    names = [short_name(e.name) for e in events[:per_call]]
    # a kernel launched twice in a call (the two GEMMs) is named by its launch: "name #1", "name #2"
    repeated = {n for n in names if names.count(n) > 1}
    seen: dict[str, int] = collections.defaultdict(int)
    labels = []
    for n in names:
        seen[n] += 1
        labels.append(f"{n} #{seen[n]}" if n in repeated else n)
    total: dict[str, float] = collections.defaultdict(float)
    for i, e in enumerate(events):
        name = labels[i % per_call] if per_call else short_name(e.name)
        total[name] += (e.time_range.end - e.time_range.start) / calls
    return dict(total)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="deepseek-v2-lite,ct-channelwise,mixtral-8x7b")
    ap.add_argument("--m", default="2,8,16")
    ap.add_argument("--providers", default="plugin-cuda,vllm-marlin")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"# Kernel breakdown of a layer call\n\n{datetime.date.today()} · {torch.cuda.get_device_name()} · "
        f"commit {git_commit()}\n\nµs per layer call: each kernel's device time (mean over {args.calls} "
        "eager L2-cold calls), their sum, and the CUDA-graph time of the call (bench_moe's timing).\n",
        "| shape | M | provider | graph µs | kernels µs | kernels |",
        "|---|---|---|---|---|---|",
    ]
    for s in [s for s in SHAPES if s.name in args.shapes.split(",")]:
        q13, q2 = make_weights(s, 4, gen)
        kw13, kw2 = packing.to_kernel_layout(q13, torch.bfloat16), packing.to_kernel_layout(q2, torch.bfloat16)
        base = Weights(kw13.qweight, kw2.qweight, kw13.scales, kw2.scales)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, s.H, generator=gen, device="cuda").to(torch.bfloat16)
            tw, ids = torch.topk(torch.randn(m, s.E, generator=gen, device="cuda").softmax(-1), s.top_k, dim=-1)
            ids = ids.to(torch.int32)
            touched = len(torch.unique(ids)) * weight_bytes_per_expert(s, 4, False)
            n_copies = max(1, min(8, math.ceil(150e6 / touched)))
            ws = [base] + [Weights(*[t.clone() for t in (base.q13, base.q2, base.scales13, base.scales2)])
                           for _ in range(n_copies - 1)]  # fmt: skip
            ao = None  # the act-order twin (bench_moe.make_act_order) for -ao providers, made when first asked
            for prov in args.providers.split(","):
                if prov.endswith(ACT_ORDER_SUFFIX) and ao is None:
                    twin = make_act_order(kw13, kw2, None, None, s, 4, gen)[0]
                    ao = [twin] + [dataclasses.replace(twin, **{f: getattr(twin, f).clone() for f in ("q13", "q2")})
                                   for _ in range(n_copies - 1)]  # fmt: skip
                prepared = [
                    plugin_backend(prov, x, w, ids, s.gs) for w in (ao if prov.endswith(ACT_ORDER_SUFFIX) else ws)
                ]

                def call(runner):  # with the kernel form a plugin-cuda-* / plugin-triton-* provider names
                    return runner.run(x, tw, ids)

                calls = [lambda b=b: call(b) for b in prepared]
                graph_us = time_graph(calls, 20)[0]
                times = kernel_times(calls, args.calls)
                detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
                lines.append(f"| {s.name} | {m} | {prov} | {graph_us:.1f} | {sum(times.values()):.1f} | {detail} |")
                print(lines[-1], flush=True)
            del ws
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (out / f"{datetime.date.today()}-{git_commit()}-breakdown.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
