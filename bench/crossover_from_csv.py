"""Write the measured cuda-over-triton crossovers from a bench_moe.py CSV already recorded (no GPU).

    python bench/crossover_from_csv.py bench/results/h200/2026-12-03-09163a5-lean-forms.csv \
        --triton-provider plugin-triton-lean --device "NVIDIA H200"

--triton-provider names the CSV column that times the Triton kernel as `auto` now runs it (a run
that timed a form before it became the default calls it plugin-triton-<form>). The ranges are
crossover.measured_ranges of plugin-cuda against that column, per shape of the CSV, merged into
the package's crossover/<device>.json with the CSV's .md as the source, exactly as
`bench_moe.py --write-crossover` would have written them in that run.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_moe import SHAPES, record_crossovers  # noqa: E402


def rows_from_csv(
    path: Path, triton_provider: str, cuda_provider: str = "plugin-cuda"
) -> list[tuple[str, int, str, tuple]]:
    """(shape, M, provider, (median µs,)) of the `cuda_provider` and `triton_provider` columns."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if not r["median_us"] or r["provider"] not in (cuda_provider, triton_provider):
                continue
            rows.append((r["shape"], int(r["M"]), r["provider"], (float(r["median_us"]),)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path)
    ap.add_argument("--triton-provider", default="plugin-triton")
    ap.add_argument(
        "--cuda-provider",
        default="plugin-cuda",
        help="the column that times the CUDA kernel as the plugin now launches it (a geometry of CUDA_FORMS "
        "measured before it became the default)",
    )
    ap.add_argument("--device", required=True, help="torch.cuda.get_device_name() of the run, e.g. 'NVIDIA H200'")
    ap.add_argument("--out", type=Path, default=ROOT / "vllm_wna16_plugin" / "crossover")
    args = ap.parse_args()
    rows = rows_from_csv(args.csv, args.triton_provider, args.cuda_provider)
    if not rows:
        raise SystemExit(f"{args.csv}: no {args.cuda_provider} or {args.triton_provider} times")
    shapes = [s for s in SHAPES if any(r[0] == s.name for r in rows)]
    source = args.csv.with_suffix(".md").resolve()
    print(
        record_crossovers(
            rows,
            shapes,
            args.device,
            args.out,
            source,
            triton_column=args.triton_provider,
            cuda_column=args.cuda_provider,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
