"""One appended CSV of layer-benchmark rows per device, and tables and plots made from it (no GPU).

    python bench/results_table.py table [--csv bench/results/h200/results.csv] --run pdl3 [--providers a,b]
        [--shapes s,t] [--m 1,2,4] [--ratio-to vllm-marlin] [--plot out.png]
    python bench/results_table.py runs [--csv ...]
    python bench/results_table.py consolidate [--dir bench/results/h200] [--csv ...]

Every row of the device CSV carries the run's device, vLLM, torch and Triton versions, commit, run name
and date beside the measurement (shape, M, provider, median/p20/p80 µs, share of the copy bandwidth).
`bench/bench_moe.py` appends its rows here at the end of every run (it still writes the run's own
.md/.csv/.png, which crossover tables cite). `consolidate` rebuilds the rows of the runs recorded before
that, from each per-run CSV and the header line of its companion .md; a field the files do not state is
written "unknown". `table` prints one run's rows as markdown, µs per provider and M, with optional
ratios to one provider; `--run` matches the run name, the commit or the file stem.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "bench" / "results" / "h200"
DEVICE_CSV = "results.csv"

COLUMNS = [
    "date",
    "device",
    "vllm",
    "torch",
    "triton",
    "commit",
    "run",
    "run_note",
    "copy_bw_tbs",
    "reps",
    "timing",
    "shape",
    "M",
    "provider",
    "median_us",
    "p20_us",
    "p80_us",
    "frac_copy_bw",
    "note",
    "source",
]
UNKNOWN = "unknown"
_HEX = re.compile(r"^[0-9a-f]{7,40}$")


def device_csv(out_dir: Path) -> Path:
    """The device's appended CSV: one per results directory (bench/results/<device>/)."""
    return Path(out_dir) / DEVICE_CSV


def split_commit(text: str) -> tuple[str, str, str]:
    """(commit, run, note) from the text after "commit " in a bench header.

    "09163a5" -> commit 09163a5; "12bbb3a-tuned-full" -> 12bbb3a, run 12bbb3a-tuned-full; "pdl3" (a run
    name set as BENCH_COMMIT on a device copy without git) -> commit unknown, run pdl3; a trailing
    "(...)" or "+ ..." is kept as the note."""
    text = text.strip()
    word, _, rest = text.partition(" ")
    head = word.split("-")[0]
    if _HEX.match(head):
        # a tree measured before it was committed is that commit's parent plus changes: say so
        return head + ("+uncommitted" if "uncommitted" in rest else ""), word, rest.strip()
    return UNKNOWN, word or UNKNOWN, rest.strip()


def append_rows(path: Path, rows: list[dict]) -> int:
    """Append rows (dicts keyed by COLUMNS; missing keys become "unknown") to the device CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            wr.writeheader()
        for r in rows:
            wr.writerow(
                {c: (UNKNOWN if r.get(c) in (None, "") and c not in _MAY_BE_EMPTY else r.get(c, "")) for c in COLUMNS}
            )
    return len(rows)


# measurement fields that are empty on purpose (a crash or n/a has no time; a timed row has no note)
_MAY_BE_EMPTY = {"run_note", "median_us", "p20_us", "p80_us", "frac_copy_bw", "note"}


def parse_header(md: Path) -> dict:
    """The run metadata a bench_moe.py .md states in its header lines; "unknown" where it says nothing."""
    meta = {
        k: UNKNOWN
        for k in ("date", "device", "vllm", "torch", "triton", "commit", "run", "copy_bw_tbs", "reps", "timing")
    }
    meta["run_note"] = ""
    if not md.exists():
        return meta
    text = md.read_text()
    for line in text.splitlines()[:6]:
        if " · " in line and "commit" in line:
            parts = [p.strip() for p in line.split(" · ")]
            meta["date"] = parts[0]
            meta["device"] = parts[1]
            for p in parts[2:]:
                key, _, val = p.partition(" ")
                if key in ("torch", "triton"):
                    meta[key] = val
                elif key == "vLLM":
                    meta["vllm"] = val
                elif key == "commit":
                    meta["commit"], meta["run"], meta["run_note"] = split_commit(val)
    m = re.search(r"copy bandwidth: ([0-9.]+) TB/s", text)
    if m:
        meta["copy_bw_tbs"] = m.group(1)
    m = re.search(r"median of (\d+) replays", text)
    if m:
        meta["reps"] = m.group(1)
    if "GPU kept busy while the host launches" in text:
        meta["timing"] = "queued"
    elif "host launch included" in text:
        meta["timing"] = "launch-included"
    return meta


def rows_of_run_csv(csv_path: Path) -> list[dict]:
    """A per-run bench_moe.py CSV with its .md's metadata on every row."""
    meta = parse_header(csv_path.with_suffix(".md"))
    stem = csv_path.stem
    if meta["date"] == UNKNOWN and re.match(r"\d{4}-\d\d-\d\d-", stem):
        meta["date"] = stem[:10]
    if re.match(r"\d{4}-\d\d-\d\d-", stem):
        meta["run"] = stem[11:]  # the file's name, which also tells runs of one commit apart
    src = str(csv_path.relative_to(ROOT)) if csv_path.is_relative_to(ROOT) else str(csv_path)
    with open(csv_path, newline="") as f:
        return [{**meta, **r, "source": src} for r in csv.DictReader(f)]


def consolidate(results_dir: Path, out: Path) -> list[tuple[str, int]]:
    """Rewrite `out` from every per-run CSV in results_dir (date order); returns (file, rows) per file."""
    files = sorted(p for p in Path(results_dir).glob("*.csv") if p.name != DEVICE_CSV)
    if out.exists():
        out.unlink()
    counts = []
    for p in files:
        counts.append((p.name, append_rows(out, rows_of_run_csv(p))))
    return counts


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def select(rows: list[dict], run: str) -> list[dict]:
    """The rows of one run: `run` matches the run name, the commit or the source file's stem."""
    out = [r for r in rows if run in (r["run"], r["commit"], Path(r["source"]).stem)]
    if not out:
        raise SystemExit(f"no rows for run {run!r}; `runs` lists them")
    return out


def markdown(rows: list[dict], providers: list[str] | None = None, ratio_to: str | None = None) -> str:
    """µs per (shape, M) and provider; with ratio_to, each provider's speed-up over that one (>1: faster)."""
    providers = providers or list(dict.fromkeys(r["provider"] for r in rows))
    cell = {(r["shape"], int(r["M"]), r["provider"]): r for r in rows}
    keys = list(dict.fromkeys((r["shape"], int(r["M"])) for r in rows))
    others = [p for p in providers if p != ratio_to] if ratio_to else []
    head = ["shape", "M", *providers, *[f"{p} × vs {ratio_to}" for p in others]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, m in keys:
        vals = []
        for p in providers:
            r = cell.get((shape, m, p))
            vals.append(
                "-" if r is None else (f"{float(r['median_us']):.1f}" if r["median_us"] else r["note"].split(":")[0])
            )
        ratios = []
        base = cell.get((shape, m, ratio_to)) if ratio_to else None
        for p in others:
            r = cell.get((shape, m, p))
            ok = base and r and base["median_us"] and r["median_us"]
            ratios.append(f"{float(base['median_us']) / float(r['median_us']):.2f}" if ok else "-")
        lines.append("| " + " | ".join([shape, str(m), *vals, *ratios]) + " |")
    r0 = rows[0]
    meta = (
        f"{r0['date']} · {r0['device']} · vLLM {r0['vllm']} · torch {r0['torch']} · triton {r0['triton']} · "
        f"commit {r0['commit']} · run {r0['run']} · median of {r0['reps']} graph replays, µs per layer call "
        f"({r0['source']})"
    )
    return meta + "\n\n" + "\n".join(lines) + "\n"


def plot(rows: list[dict], providers: list[str], path: Path) -> None:
    """µs per layer call vs M, one panel per shape, log-log (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for prov in providers:
            pts = [
                (int(r["M"]), float(r["median_us"]))
                for r in rows
                if r["shape"] == shape and r["provider"] == prov and r["median_us"]
            ]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", ms=3, label=prov)
        ax.set(xscale="log", yscale="log", title=shape, xlabel="M (tokens)", ylabel="µs per MoE layer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="rebuild the device CSV from the per-run CSVs of --dir")
    c.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    c.add_argument("--csv", type=Path, default=None)
    r = sub.add_parser("runs", help="list the runs in the device CSV")
    r.add_argument("--csv", type=Path, default=device_csv(DEFAULT_DIR))
    t = sub.add_parser("table", help="markdown table of one run")
    t.add_argument("--csv", type=Path, default=device_csv(DEFAULT_DIR))
    t.add_argument("--run", required=True)
    t.add_argument("--providers", default=None)
    t.add_argument("--shapes", default=None)
    t.add_argument("--m", default=None)
    t.add_argument("--ratio-to", default=None)
    t.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)

    if args.cmd == "consolidate":
        out = args.csv or device_csv(args.dir)
        counts = consolidate(args.dir, out)
        for name, n in counts:
            print(f"{n:5d} rows  {name}")
        print(f"{sum(n for _, n in counts)} rows from {len(counts)} files -> {out}")
        return 0
    rows = read(args.csv)
    if args.cmd == "runs":
        seen = {}
        for row in rows:
            seen.setdefault((row["date"], row["run"], row["commit"], row["vllm"], row["source"]), 0)
            seen[(row["date"], row["run"], row["commit"], row["vllm"], row["source"])] += 1
        for (date, run, commit, vllm, src), n in seen.items():
            print(f"{date}  run {run:<24} commit {commit:<8} vLLM {vllm:<8} {n:4d} rows  {src}")
        return 0
    rows = select(rows, args.run)
    if args.shapes:
        rows = [x for x in rows if x["shape"] in args.shapes.split(",")]
    if args.m:
        rows = [x for x in rows if x["M"] in args.m.split(",")]
    providers = args.providers.split(",") if args.providers else None
    print(markdown(rows, providers, args.ratio_to))
    if args.plot:
        plot(rows, providers or list(dict.fromkeys(x["provider"] for x in rows)), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
