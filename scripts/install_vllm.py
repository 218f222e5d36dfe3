#!/usr/bin/env python3
"""Install one vLLM release into the current Python environment, even where its pins cannot resolve.

    python scripts/install_vllm.py 0.34.0            # or 0.26.0, ...
    python scripts/install_vllm.py 0.34.0 --dry-run  # print the requirements only

Why: vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which the package index does not carry (it has
0.7.2.post1 and 0.7.4), so ``pip install vllm==0.34.0`` fails to resolve. This script installs the vLLM
wheel with ``--no-deps`` and then vLLM's own requirements (read from the wheel's metadata, markers and
all), with the pins in ``OVERRIDES`` replaced. Every other pin is vLLM's. It first tries a plain
``pip install vllm==VERSION`` unless ``--no-plain`` is given; only when that cannot resolve does it fall
back. Standard library and pip only, so it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# distribution name (normalized) -> requirement used instead of vLLM's pin, per vLLM version.
# Each entry says why; remove it when the index carries the pinned version.
OVERRIDES: dict[str, dict[str, str]] = {
    # flashinfer-python 0.7.3 is not on the index; 0.7.4 is the next release (same API).
    "0.34.0": {"flashinfer-python": "flashinfer-python==0.7.4"},
}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pip(*args: str) -> int:
    cmd = [sys.executable, "-m", "pip", *args]
    print("install_vllm: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply without extras (markers kept for pip to evaluate)."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    return [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]


def requirement_name(req: str) -> str:
    name = req.split(";")[0].strip()
    for sep in "[<>=!~ (":
        name = name.split(sep)[0]
    return _norm(name)


def apply_overrides(reqs: list[str], version: str) -> list[str]:
    over = {_norm(k): v for k, v in OVERRIDES.get(version, {}).items()}
    return [over.get(requirement_name(r), r) for r in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="vLLM version, e.g. 0.34.0")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain `pip install vllm==VERSION` try")
    ap.add_argument("--dry-run", action="store_true", help="print the requirements that would be installed")
    args = ap.parse_args(argv)
    version = args.version
    if not args.dry_run and not args.no_plain and version not in OVERRIDES:
        return _pip("install", f"vllm=={version}")
    with tempfile.TemporaryDirectory(prefix="install-vllm-") as tmp:
        if _pip("download", "-q", "--no-deps", "-d", tmp, f"vllm=={version}") != 0:
            print(f"install_vllm: cannot download vllm=={version}", file=sys.stderr)
            return 1
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        reqs = apply_overrides(wheel_requirements(wheel), version)
        if args.dry_run:
            print("\n".join(reqs))
            return 0
        req_file = Path(tmp, "requirements.txt")
        req_file.write_text("\n".join(reqs) + "\n")
        rc = _pip("install", "-r", str(req_file))
        if rc == 0:
            rc = _pip("install", "--no-deps", str(wheel))
    if rc == 0:
        print(f"install_vllm: vLLM {version} installed", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
