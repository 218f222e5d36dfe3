"""The read floor of a MoE layer call (GPU): how fast the device streams the bytes a call reads, timed as
bench_moe.py times a layer (CUDA-graph replay over rotating L2-cold copies), for the weight bytes of 1-8
experts of a shape.

    python bench/read_floor.py --shape mixtral-8x7b --experts 2,3,4,8

Three forms per size: one streaming read of all the bytes (a persistent Triton kernel that sums int32
words: no write traffic), the same bytes read by two back-to-back kernels split 2:1 as the layer's two
GEMMs (gate/up, down), and torch's device copy of them (read + write). The question it answers: at small
batches, is a layer slow against the large-copy bandwidth (bench_moe's '%bw') because its kernels are, or
because a call that reads ~200 MB cannot reach that bandwidth at all (ramp-up, the kernel boundary)?
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_moe import ROOT, SHAPES, git_commit, measure_copy_bandwidth, time_graph, weight_bytes_per_expert


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    """out[pid] = sum of the int32 words this program read: programs stride over blocks of BLOCK words."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        acc += tl.load(src + start + offs, mask=start + offs < n_words, other=0)
    tl.store(out + pid, tl.sum(acc))


def read(buf: torch.Tensor, out: torch.Tensor, block: int = 4096) -> None:
    _read_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=block, num_warps=8)


@triton.jit
def _tile_read_kernel(src, out, n_tiles, k_tiles, pitch, R: tl.constexpr, C: tl.constexpr):
    """The stream GEMM kernel's read pattern without its math: one-warp programs each take one contiguous
    range of the flattened (R-row block, C-word column tile) space, column tiles fastest, rows `pitch`
    words apart, one R x C tile per iteration."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start = n_tiles * pid // nprog
    end = n_tiles * (pid + 1) // nprog
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    acc = tl.zeros([R, C], dtype=tl.int32)
    for t in range(start, end):
        block = t // k_tiles
        ktile = t - block * k_tiles
        acc += tl.load(src + (block * R + rows)[:, None] * pitch + ktile * C + cols[None, :])
    tl.store(out + pid, tl.sum(tl.sum(acc, 1), 0))


def tile_read(buf: torch.Tensor, out: torch.Tensor, rows: int, pitch: int, r: int, c: int) -> None:
    """Read rows x pitch int32 words of buf in r x c tiles (c words of a row per tile)."""
    k_tiles = pitch // c
    _tile_read_kernel[(out.numel(),)](buf, out, rows // r * k_tiles, k_tiles, pitch, R=r, C=c, num_warps=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mixtral-8x7b")
    ap.add_argument("--experts", default="2,3,4,8")
    ap.add_argument("--programs-per-sm", default="4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200"))
    args = ap.parse_args()
    shape = next(s for s in SHAPES if s.name == args.shape)
    bw = measure_copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [
        f"# Read floor of a layer call: {shape.name}\n\n{datetime.date.today()} · {torch.cuda.get_device_name()} · "
        f"commit {git_commit()}\n\nbytes = int4 weight bytes of the experts hit (bench_moe's), µs per call "
        f"(graph replay, rotating L2-cold copies, median of {args.reps}), % of the copy bandwidth "
        f"{bw / 1e12:.2f} TB/s. 'read': one streaming read; 'read 2:1': two kernels; 'copy': read + write.\n",
        "| experts | MB | form | µs | % copy bw |",
        "|---|---|---|---|---|",
    ]
    for n in [int(v) for v in args.experts.split(",")]:
        nbytes = int(n * weight_bytes_per_expert(shape, 4, False)) // 16 * 16
        copies = max(2, -(-600_000_000 // nbytes))
        bufs = [
            torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)
        ]
        first = nbytes // 4 * 2 // 3 // 1024 * 1024  # the gate/up share of the words
        forms = {}
        for per_sm in [int(v) for v in args.programs_per_sm.split(",")]:
            out = torch.empty(per_sm * sms, dtype=torch.int32, device="cuda")
            forms[f"read ({per_sm}/SM)"] = [lambda b=b, o=out: read(b, o) for b in bufs]
            forms[f"read 2:1 ({per_sm}/SM)"] = [
                lambda b=b, o=out: (read(b[:first], o), read(b[first:], o)) for b in bufs
            ]
        # the two GEMMs' patterns (32 rows x 128 bytes per warp step, rows of K/2 bytes), on this many bytes
        for gemm, k in (("gate/up", shape.H), ("down", shape.I)):
            pitch = k // 8  # int32 words of an int4 row
            rows = (first if gemm == "gate/up" else nbytes // 4 - first) // pitch // 32 * 32
            for r, c in ((32, 32), (8, 128), (4, 256)):
                if pitch % c == 0:
                    out = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
                    forms[f"{gemm} rows {r} x {4 * c} B"] = [
                        lambda b=b, o=out, rows=rows, pitch=pitch, r=r, c=c: tile_read(b, o, rows, pitch, r, c)
                        for b in bufs
                    ]
        dst = torch.empty_like(bufs[0])
        forms["copy"] = [lambda b=b, d=dst: d.copy_(b) for b in bufs]
        for form, fns in forms.items():
            med = time_graph(fns, args.reps)[0]
            size = nbytes
            if form.startswith(("gate/up", "down")):
                size = (first if form.startswith("gate/up") else nbytes // 4 - first) * 4
            frac = (2 if form == "copy" else 1) * size / (med * 1e-6) / bw
            lines.append(f"| {n} | {size / 1e6:.1f} | {form} | {med:.1f} | {100 * frac:.0f}% |")
            print(lines[-1], flush=True)
        del bufs, dst
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today()}-{git_commit()}-read-floor.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
