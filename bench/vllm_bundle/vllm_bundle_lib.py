#!/usr/bin/env python3
"""Helpers for vllm-bundle.sh (build side; standard library only).

Project copy of ../shared/device/vllm_bundle_lib.py, extended for vLLM 0.34:
more strip paths, and an xgrammar stub that also covers `xgrammar.<sub>`
imports and import-time construction of its data types (it is written only
when the bundle holds no real xgrammar; the 0.34 requirements carry one).

Subcommands:
  unpack-wheel WHEEL DEST          unzip a wheel into a flat site dir
                                   (.data/purelib and .data/platlib merged)
  strip-vllm SITE PYTAG [--keep-flash-attn] [--strip-file F]
                                   drop what the bundle does not need (F: more
                                   site-relative paths, one a line, # comments)
  zero-cubins SITE --keep-sm N [--drop-redundant-ptx] [--report F]
                                   zero the payload of fatbin entries that a
                                   GPU of compute capability N can never load
  xgrammar-stub SITE               write the xgrammar placeholder package
  render TEMPLATE OUT KEY=VALUE... substitute @@KEY@@ in a template
  check-sizes OUTDIR MAXBYTES      assert every part-* is below MAXBYTES
"""

import collections
import os
import shutil
import struct
import sys
import zipfile

# ----------------------------------------------------------------- wheels


def unpack_wheel(whl, dest):
    os.makedirs(dest, exist_ok=True)
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                # <dist>.data/<scheme>/...: keep purelib/platlib, drop the rest
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            if name.endswith("/") or not name:
                continue
            target = os.path.join(dest, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode | 0o644)


# ------------------------------------------------------------- strip vllm

# Paths (relative to the site dir) removed from the vllm wheel. Globs are
# matched with fnmatch against the relative path.
STRIP_PATHS = [
    "vllm/vllm-rs",  # Rust HTTP front end (serve only), 41 MiB
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # 290 MiB; use TRITON_ATTN
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",  # 146 MiB
    "vllm/third_party/deep_gemm/include",  # JIT headers (fp8 DeepGEMM only)
    "vllm/third_party/fmha_sm100/cutlass",  # sm100 JIT headers
    "vllm/third_party/fmha_sm100/csrc",
    # also for vLLM 0.34 (paths that a version or bundle lacks are skipped)
    "vllm/entrypoints/serve/instrumentator/static",  # swagger UI for offline /docs (optional)
    "tvm_ffi/3rdparty",  # apache-tvm-ffi (xgrammar): libbacktrace sources
    "tvm_ffi/src",  # its C++ sources (the built libraries stay)
]


def read_strip_file(path):
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                if line.startswith("/") or ".." in line.split("/"):
                    raise SystemExit(f"strip file {path}: {line!r} is not a path inside the site dir")
                out.append(line.rstrip("/"))
    return out


def strip_vllm(site, pytag, keep_flash_attn=False, strip_file=None):
    import fnmatch

    removed = 0

    def rm(p):
        nonlocal removed
        if os.path.isdir(p) and not os.path.islink(p):
            for dp, _, fn in os.walk(p):
                for f in fn:
                    removed += os.path.getsize(os.path.join(dp, f))
            shutil.rmtree(p)
        elif os.path.lexists(p):
            removed += os.path.getsize(p)
            os.remove(p)

    for rel in STRIP_PATHS:
        if keep_flash_attn and "vllm_flash_attn" in rel:
            continue
        rm(os.path.join(site, rel))
    if strip_file:
        for rel in read_strip_file(strip_file):
            p = os.path.join(site, rel)
            if not os.path.lexists(p):
                print(f"strip-vllm: {rel} (from {os.path.basename(strip_file)}) is not in the bundle")
            before = removed
            rm(p)
            if removed > before:
                print(f"strip-vllm: dropped {rel} ({(removed - before) / 2**20:.1f} MiB)")
    # CPython-specific extension modules for other interpreters
    # (vllm/third_party/deep_gemm/_C.cpython-31X-...so)
    for dp, _dn, fn in os.walk(os.path.join(site, "vllm")):
        for f in fn:
            if ".cpython-" in f and f.endswith(".so") and f".cpython-{pytag[2:]}-" not in f:
                rm(os.path.join(dp, f))
            elif fnmatch.fnmatch(f, "*.cu") or fnmatch.fnmatch(f, "*.cuh"):
                rm(os.path.join(dp, f))
    if not keep_flash_attn:
        patch_flash_attn_guard(site)
    # vllm's RECORD lists the files removed above; importlib.metadata does not
    # need it (METADATA gives the version that platform detection reads).
    for d in os.listdir(site):
        if d.startswith("vllm-") and d.endswith(".dist-info"):
            rm(os.path.join(site, d, "RECORD"))
    print(f"strip-vllm: removed {removed / 2**20:.1f} MiB")


FA_INIT = "vllm/vllm_flash_attn/__init__.py"
FA_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
FA_GUARD_NEW = (
    "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # vllm-bundle: FA .so stripped\n    raise ImportError("
)


def patch_flash_attn_guard(site):
    """vllm/vllm_flash_attn/__init__.py raises ImportError when neither FA .so
    is present, and model files import it at module level (mixtral.py ->
    layers/attention -> mm_encoder_attention -> v1/attention/backends/fa_utils),
    so vllm.LLM fails to inspect any model. Disable that one guard: the
    flash-attn entry points stay importable, FA2/FA3 report themselves
    unavailable (is_fa_version_supported -> False) and the TRITON_ATTN backend
    does the attention."""
    p = os.path.join(site, FA_INIT)
    if not os.path.exists(p):
        return
    with open(p) as fh:
        text = fh.read()
    if FA_GUARD in text:
        with open(p, "w") as fh:
            fh.write(text.replace(FA_GUARD, FA_GUARD_NEW, 1))
        print("strip-vllm: patched the flash-attn import guard in " + FA_INIT)
    elif FA_GUARD_NEW not in text:
        print(
            "strip-vllm: WARNING: flash-attn import guard not found in "
            + FA_INIT
            + "; without the FA .so, importing model files may fail (use --keep-flash-attn)"
        )


# ---------------------------------------------------------------- fatbins

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


class FatbinError(Exception):
    pass


def elf_section(data, want):
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a little-endian ELF64 file")
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    shs = []
    for i in range(e_shnum):
        o = e_shoff + i * e_shentsize
        name, typ, flags, addr, off, size = struct.unpack_from("<IIQQQQ", data, o)
        shs.append((name, typ, off, size))
    stroff = shs[e_shstrndx][2]
    for name, typ, off, size in shs:
        n = data[stroff + name : data.index(b"\0", stroff + name)].decode()
        if n == want:
            if typ == 8:  # SHT_NOBITS
                return None
            if off + size > len(data):
                raise FatbinError(f"{want} runs past the end of the file")
            return off, size
    return None


def fatbin_containers(data, off, size):
    """Yield (container_offset, [entry dicts]) for each fatbin container."""
    end = off + size
    p = off
    while p + 16 <= end:
        magic, ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            # containers are 8-byte aligned; the gaps are zero padding
            if data[p : p + 8] != bytes(8):
                raise FatbinError(f"unexpected bytes at 0x{p:x} between containers")
            p += 8
            continue
        if hsz != 16 or p + hsz + fsz > end:
            raise FatbinError(f"bad container header at 0x{p:x}")
        q = p + hsz
        cend = q + fsz
        ents = []
        while q < cend:
            if q + 64 > cend:
                raise FatbinError(f"truncated entry header at 0x{q:x}")
            (kind, _u1, ehs, esz, _csz, _u2, _minor, _major, arch, _no, _nl, flags, _zero, _dsz) = struct.unpack_from(
                "<HHIQIIHHIIIQQQ", data, q
            )
            if kind not in (KIND_PTX, KIND_ELF) or ehs < 64 or q + ehs + esz > cend:
                raise FatbinError(f"bad entry header at 0x{q:x}")
            ents.append(dict(hdr=q, kind=kind, arch=arch, flags=flags, payload=q + ehs, size=esz))
            q += ehs + esz
        yield p, ents
        p = cend


def zero_cubins(site, keep_sm, drop_redundant_ptx=False, report=None):
    """Zero fatbin payloads a compute-capability-`keep_sm` GPU cannot use.

    Kept: every ELF (SASS) entry whose arch equals keep_sm (sm_90 and sm_90a
    both report 90) and every PTX entry (the driver JIT-compiles PTX for
    kernels that have no matching SASS, e.g. vLLM's Marlin MoE, built for
    sm_80+PTX). Zeroed: ELF entries for other archs -- SASS only runs on
    its own major version, so an sm_90 GPU never selects sm_80/sm_100/sm_120
    code. With drop_redundant_ptx, PTX entries in a container that also holds
    a keep_sm ELF entry are zeroed too (the driver prefers the matching SASS).
    Entry headers are left intact; only payload bytes become zeros, so the
    file keeps its size and layout and xz compresses the zeros away.
    """
    lines = []
    total_zeroed = 0
    for dp, _dn, fn in os.walk(site):
        for f in sorted(fn):
            if not f.endswith(".so"):
                continue
            path = os.path.join(dp, f)
            if os.path.islink(path):
                continue
            with open(path, "rb") as fh:
                data = fh.read()
            try:
                sec = elf_section(data, ".nv_fatbin")
                if sec is None:
                    continue
                buf = bytearray(data)
                stat = collections.Counter()
                zeroed = 0
                for _c, ents in fatbin_containers(data, *sec):
                    has_sass = any(e["kind"] == KIND_ELF and e["arch"] == keep_sm for e in ents)
                    for e in ents:
                        tag = ("ptx" if e["kind"] == KIND_PTX else "sm") + str(e["arch"])
                        kill = (e["kind"] == KIND_ELF and e["arch"] != keep_sm) or (
                            drop_redundant_ptx and e["kind"] == KIND_PTX and has_sass
                        )
                        stat[(tag, "zeroed" if kill else "kept")] += e["size"]
                        if kill:
                            buf[e["payload"] : e["payload"] + e["size"]] = bytes(e["size"])
                            zeroed += e["size"]
            except (FatbinError, struct.error, ValueError) as ex:
                lines.append(f"{os.path.relpath(path, site)}: left untouched ({ex})")
                continue
            if zeroed:
                tmp = path + ".tmp"
                with open(tmp, "wb") as fh:
                    fh.write(buf)
                os.chmod(tmp, os.stat(path).st_mode)
                os.replace(tmp, path)
            total_zeroed += zeroed
            detail = ", ".join(f"{t} {k} {v / 2**20:.1f}M" for (t, k), v in sorted(stat.items()))
            lines.append(f"{os.path.relpath(path, site)}: zeroed {zeroed / 2**20:.1f} MiB [{detail}]")
    lines.append(
        f"total zeroed: {total_zeroed / 2**20:.1f} MiB (keep sm_{keep_sm}"
        f"{', redundant PTX dropped' if drop_redundant_ptx else ', all PTX kept'})"
    )
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if report:
        with open(report, "w") as fh:
            fh.write(text)


# --------------------------------------------------------- xgrammar stub

XGRAMMAR_STUB = '''"""Placeholder for xgrammar, written by vllm-bundle.sh.

vLLM evaluates xgrammar names at import time: 0.26.0 in dataclass annotations
(vllm/v1/structured_output/backend_xgrammar.py), 0.34.0 also through
`from xgrammar.structural_tag import ...` and
`from xgrammar.openai_tool_call_schema import ...` (vllm/parser/*,
vllm/tool_parsers/structural_tag_registry.py). The real wheel is ~45 MB, so
the bundle ships this stub: any attribute of `xgrammar` or of any
`xgrammar.<sub>` module resolves to a placeholder class, and instantiating or
calling one raises ImportError. Structured output with the xgrammar backend
(and structural-tag tool calling) is therefore unavailable; plain generation
is unaffected. Carry the real xgrammar wheel (and apache-tvm-ffi) to lift this.
"""
import importlib.abc as _abc
import importlib.machinery as _machinery
import sys as _sys
import types as _types

__version__ = "0.0.0+vllm-bundle-stub"
__vllm_bundle_stub__ = True
__path__ = []  # a package: `import xgrammar.<sub>` goes through _Finder below

_MSG = ("xgrammar is a stub in this vllm bundle (structured output with the "
        "xgrammar backend is unavailable); carry the real xgrammar wheel")


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(cls.__qualname__ + "." + name)

    def __call__(cls, *a, **k):
        # Plain data types (xgrammar.structural_tag's *Format classes,
        # StructuralTag, openai_tool_call_schema's *Param) may be built at
        # import time (vllm 0.34's vllm/parser/harmony.py does
        # `_ANY_CONTENT = AnyTextFormat()`): they give an inert instance,
        # which raises as soon as anything is read from it. Everything else
        # (GrammarCompiler, TokenizerInfo.from_huggingface, ...) raises here.
        leaf = cls.__qualname__.rsplit(".", 1)[-1]
        if leaf.endswith(("Format", "StructuralTag", "Param")):
            return _Inert(cls.__qualname__)
        raise ImportError(_MSG + " (used: " + cls.__qualname__ + ")")

    def __getitem__(cls, item):  # Format[...] in annotations
        return cls


def _placeholder(name):
    return _Meta(name, (), {"__module__": __name__, "__qualname__": name})


class _Inert:
    __slots__ = ("_vb_name",)

    def __init__(self, name):
        object.__setattr__(self, "_vb_name", name)

    def __getattr__(self, name):
        raise ImportError(_MSG + " (used: " + self._vb_name + "()." + name + ")")

    def __repr__(self):
        return "<xgrammar stub " + self._vb_name + ">"


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(name)


__getattr__ = _module_getattr


class _Finder(_abc.MetaPathFinder, _abc.Loader):
    """Makes every `xgrammar.<sub>` importable as a stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return _machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None  # default module creation

    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = __version__
        module.__vllm_bundle_stub__ = True
        module.__getattr__ = _module_getattr


if not any(isinstance(f, _Finder) or type(f).__name__ == "_Finder" and
           getattr(f, "__module__", "") == __name__ for f in _sys.meta_path):
    _sys.meta_path.append(_Finder())
'''


def xgrammar_stub(site):
    d = os.path.join(site, "xgrammar")
    if os.path.exists(d):
        print("xgrammar-stub: a real xgrammar is in the bundle; no stub written")
        return
    os.makedirs(d)
    with open(os.path.join(d, "__init__.py"), "w") as fh:
        fh.write(XGRAMMAR_STUB)


# ---------------------------------------------------------------- misc


def render(template, out, pairs):
    with open(template) as fh:
        text = fh.read()
    for kv in pairs:
        k, v = kv.split("=", 1)
        text = text.replace(f"@@{k}@@", v)
    if "@@" in text:
        left = sorted(set(t.split("@@")[0] for t in text.split("@@")[1::2]))
        raise SystemExit(f"render: unreplaced placeholders in {template}: {left}")
    with open(out, "w") as fh:
        fh.write(text)
    os.chmod(out, 0o755)


def check_sizes(outdir, maxbytes):
    bad = []
    for f in sorted(os.listdir(outdir)):
        if f.startswith("part-"):
            s = os.path.getsize(os.path.join(outdir, f))
            if s >= maxbytes:
                bad.append(f"{f}: {s} bytes >= {maxbytes}")
    if bad:
        raise SystemExit("check-sizes: " + "; ".join(bad))


def main(argv):
    if not argv:
        raise SystemExit(__doc__)
    cmd, args = argv[0], argv[1:]
    if cmd == "unpack-wheel":
        unpack_wheel(args[0], args[1])
    elif cmd == "strip-vllm":
        sf = None
        if "--strip-file" in args[2:]:
            sf = args[args.index("--strip-file") + 1]
        strip_vllm(args[0], args[1], "--keep-flash-attn" in args[2:], sf)
    elif cmd == "zero-cubins":
        import argparse

        ap = argparse.ArgumentParser(prog="zero-cubins")
        ap.add_argument("site")
        ap.add_argument("--keep-sm", type=int, required=True)
        ap.add_argument("--drop-redundant-ptx", action="store_true")
        ap.add_argument("--report")
        a = ap.parse_args(args)
        zero_cubins(a.site, a.keep_sm, a.drop_redundant_ptx, a.report)
    elif cmd == "xgrammar-stub":
        xgrammar_stub(args[0])
    elif cmd == "render":
        render(args[0], args[1], args[2:])
    elif cmd == "check-sizes":
        check_sizes(args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown subcommand {cmd}\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
