"""Tables tuned on the user's own GPU (`vllm-wna16 tune`), which the launch plan prefers to the shipped ones.

    <root>/<device>/driver-<driver version>/plugin-<plugin version>/
        crossover/<device>.json     where cuda beats triton per layer shape (crossover.py's format)
        configs/E=...,device_name=<device>.json    Triton configs per GEMM shape (configs.py's format)
        runs/<time>.json            what each tune run timed, for the record

root: $VLLM_WNA16_PLUS_TUNED_DIR, else $XDG_CACHE_HOME/vllm-wna16-plugin/tuned, else
~/.cache/vllm-wna16-plugin/tuned. The directory is keyed by the device name, the NVIDIA driver's
version and the plugin's version, so a driver or plugin upgrade reads none of an older one's entries
(tune again). The tables have the shipped tables' formats and loaders (one home each): a lookup
tries the user's directory first, then the shipped one, then the heuristic, and the plan's "why"
and "source" say which answered. VLLM_WNA16_PLUS_TUNED=0 ignores the user's tables. Reading them
costs one small JSON read per table, once per process, at the first plan of a layer shape (never at
import).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vllm_wna16_plugin import __version__, _vllm
from vllm_wna16_plugin.kernels.options import DeviceSpec

logger = _vllm.init_logger(__name__)
T = TypeVar("T")
_announced: set[Path] = set()

ENV_DIR = "VLLM_WNA16_PLUS_TUNED_DIR"
ENV_USE = "VLLM_WNA16_PLUS_TUNED"


def tuned_root(environ=None) -> Path:
    """The root of every device's tuned tables (module docstring)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DIR):
        root = Path(env[ENV_DIR]).expanduser()
        if root.exists() and not root.is_dir():  # a typo'd file: every table would be silently ignored
            raise ValueError(
                f"{ENV_DIR}={env[ENV_DIR]!r} names a file, not a directory; point it at a directory (new or one "
                "vllm-wna16 tune wrote), or unset it for ~/.cache/vllm-wna16-plugin/tuned"
            )
        return root
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "vllm-wna16-plugin" / "tuned"


def use_tuned(environ=None) -> bool:
    """VLLM_WNA16_PLUS_TUNED: unset, 1/true/yes/on read the user's tables, 0/false/no/off ignore them; any other
    value is a ValueError naming the variable (checked when a layer is built, moe_method._select, and by doctor).
    When on, VLLM_WNA16_PLUS_TUNED_DIR is checked too (tuned_root)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_USE, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        tuned_root(env)
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENV_USE}={env.get(ENV_USE)!r}: use 1 (read the tables vllm-wna16 tune wrote) or 0 (ignore them)"
    )


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def tuned_dir(device: DeviceSpec, environ=None, *, must_exist: bool = True) -> Path | None:
    """This device's directory of user-tuned tables, or None: no device name or driver version (a device
    only described, e.g. doctor's sm90), VLLM_WNA16_PLUS_TUNED=0, or (must_exist) nothing tuned yet."""
    env = os.environ if environ is None else environ
    if not use_tuned(env) or not device.name or not device.driver:
        return None
    path = tuned_root(env) / _safe(device.name) / f"driver-{_safe(device.driver)}" / f"plugin-{_safe(__version__)}"
    if must_exist:
        if not path.is_dir():
            return None
        if path not in _announced:
            _announced.add(path)
            logger.info("moe_wna16_plus: using the tables tuned on this GPU in %s (before the shipped ones; "
                        "%s=0 ignores them)", path, ENV_USE)  # fmt: skip
    return path


_refused: set[str] = set()


def read_safely(load: Callable[[], T], what: str) -> T | None:
    """load() of a user table, or None (logged once) when the file is damaged or stale: an interrupted tune,
    an entry this plugin no longer takes. The shipped tables are read without this: a bad one is a bug."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - a user's file never stops serving: JSON, shape, type, depth errors
        if what not in _refused:
            _refused.add(what)
            logger.warning("moe_wna16_plus: ignoring the tuned table %s (%s); the shipped tables are used. "
                           "Run vllm-wna16 tune again, or delete the file", what, exc)  # fmt: skip
        return None


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a reader never sees half a table."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def crossover_dir(device: DeviceSpec, environ=None) -> Path | None:
    path = tuned_dir(device, environ)
    return None if path is None else path / "crossover"


def configs_dir(device: DeviceSpec, environ=None) -> Path | None:
    path = tuned_dir(device, environ)
    return None if path is None else path / "configs"


__all__ = [
    "ENV_DIR",
    "ENV_USE",
    "configs_dir",
    "crossover_dir",
    "read_safely",
    "tuned_dir",
    "tuned_root",
    "use_tuned",
    "write_atomically",
]
