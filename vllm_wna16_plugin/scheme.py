"""The one parsed truth about a WNA16 checkpoint: `WNA16Scheme`.

Every checkpoint format (GPTQ, AWQ, compressed-tensors pack-quantized) is parsed
into this value by `checkpoint_config.py`; everything downstream (weight loading,
launch configs, backend selection, kernels) reads only this. `group_size == -1`
means channel-wise (one group spanning all of K); `None` never survives parsing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SUPPORTED_BITS = (4, 8)
CHANNELWISE = -1

_JSON_TYPES = ((bool, "a bool"), (int, "an int"), (float, "a float"), (str, "a string"), (list, "a list"),
               (tuple, "a list"), (dict, "a JSON object"), (type(None), "null"))  # fmt: skip


def type_name(value: object) -> str:
    """How a config value reads to its author: "a string" for "4", "a bool" for true, "null" for None."""
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), f"a {type(value).__name__}")


def not_an_int(value: object) -> str | None:
    """None for a real int (bools excluded), else "is a string, not an int" and the like."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    return f"is {type_name(value)}, not an int"


class PackFormat(enum.Enum):
    """How the checkpoint stores its integers on disk."""

    GPTQ = "gptq"  # int32 packed along K: qweight (K // pack, N), qzeros (G, N // pack)
    AWQ = "awq"  # int32 packed along N in AWQ order: qweight (K, N // pack)
    CT_PACKED = "compressed-tensors"  # int32 packed along K: weight_packed (N, K // pack)


@dataclass(frozen=True)
class WNA16Scheme:
    """Weight-only integer quantization of one model's MoE experts.

    bits: 4 or 8. group_size: a positive number of K elements per scale, or -1
    for channel-wise. has_zero_point: asymmetric (a zero point per group) when
    True; symmetric (the midpoint 2**(bits-1)) when False. desc_act: GPTQ act
    order (a g_idx per K row). zero_point_offset: 1 for GPTQ v1 checkpoints,
    whose stored zero points are one less than the true ones, else 0.
    """

    bits: int
    group_size: int
    has_zero_point: bool
    pack_format: PackFormat
    desc_act: bool = False
    zero_point_offset: int = 0
    source: str = ""  # e.g. "gptq", "awq", "compressed-tensors": for messages

    def __post_init__(self) -> None:
        for name in ("bits", "group_size", "zero_point_offset"):
            value = getattr(self, name)
            if (problem := not_an_int(value)) is not None:
                raise ValueError(f"{name}={value!r} {problem}; supported: an int")
        for name in ("has_zero_point", "desc_act"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is {type_name(value)}, not a bool; supported: True, False")
        if not isinstance(self.pack_format, PackFormat):
            raise ValueError(
                f"pack_format={self.pack_format!r} is not a PackFormat; supported: "
                + ", ".join(f"PackFormat.{f.name}" for f in PackFormat)
            )
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported; supported: {list(SUPPORTED_BITS)}")
        if self.group_size != CHANNELWISE and self.group_size <= 0:
            raise ValueError(
                f"group_size={self.group_size} is not supported; use a positive group size or -1 (channel-wise)"
            )
        if self.zero_point_offset not in (0, 1):
            raise ValueError(f"zero_point_offset must be 0 or 1, got {self.zero_point_offset}")

    @property
    def is_channelwise(self) -> bool:
        return self.group_size == CHANNELWISE

    @property
    def pack_factor(self) -> int:
        """Values per int32 word on disk (8 for int4, 4 for int8)."""
        return 32 // self.bits

    @property
    def symmetric_zero(self) -> int:
        """The implied zero point of a symmetric scheme: 8 for int4, 128 for int8."""
        return 1 << (self.bits - 1)

    def group_size_for(self, size_k: int) -> int:
        """The group size in K elements for a GEMM whose reduction dim is size_k."""
        return size_k if self.is_channelwise else self.group_size

    def num_groups(self, size_k: int) -> int:
        """Number of scale groups along K (1 when channel-wise); K must be a multiple of the group size."""
        gs = self.group_size_for(size_k)
        if size_k % gs:
            raise ValueError(
                f"group_size={gs} does not divide K={size_k}; supported: a divisor of K or -1 (channel-wise)"
            )
        return size_k // gs

    def describe(self) -> str:
        gs = "channel-wise" if self.is_channelwise else f"group {self.group_size}"
        zp = "asymmetric" if self.has_zero_point else "symmetric"
        act = ", act-order" if self.desc_act else ""
        return f"{self.source or self.pack_format.value} int{self.bits} {gs} {zp}{act}"


def normalize_group_size(value: int | None) -> int:
    """None and -1 both mean channel-wise; returns -1 for them, else the int (never a parsed string)."""
    if value is None:
        return CHANNELWISE
    if (problem := not_an_int(value)) is not None:
        raise ValueError(f"group_size={value!r} {problem}; supported: a positive int or -1 / None (channel-wise)")
    return value
