"""What the kernels are told, as values: the device a launch is planned for and the kernels' switches.

    DeviceSpec(platform, sm, name, sm_count)   what a plan may know about a GPU (no driver call once built)
    KernelOptions(...)                         every switch of the Triton and CUDA launchers, frozen

Benchmarks and tests that time or check another form build one with `dataclasses.replace`, and the
launchers take it as an argument: no module global is flipped. Each default names its evidence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

PLATFORMS = ("cuda", "rocm", "xpu", "cpu", "interpreter")
DOT_NIBBLE_FORMS = ("auto", "interleave", "split", "words")
PAIR_STEP_FORMS = ("fold", "tile")
TRITON_ACT_ORDER_FORMS = ("auto", "load", "rows")
CUDA_KERNELS = ("auto", "mma", "gemv")
H200_SMS = 132


@dataclass(frozen=True)
class DeviceSpec:
    """A device a launch is planned for. name: the file name the tuned-config and crossover tables use
    (torch.cuda.get_device_name), None where no table applies; sm_count: streaming multiprocessors;
    driver: the NVIDIA driver's version on this machine (the key of the user's own tuned tables,
    user_tables.py), None for a device that is only described (doctor's plans)."""

    platform: str
    sm: int | None = None
    name: str | None = None
    sm_count: int = H200_SMS
    driver: str | None = None

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform={self.platform!r} is not one of {list(PLATFORMS)}")
        if self.sm_count < 1:
            raise ValueError(f"sm_count={self.sm_count} must be positive")

    @property
    def sm_major(self) -> int:
        return 0 if self.sm is None else self.sm // 10

    def describe(self) -> str:
        what = self.name or self.platform
        return what + ("" if self.sm is None else f" (sm{self.sm}, {self.sm_count} SMs)")

    @staticmethod
    def of(device: torch.device) -> DeviceSpec:
        """This machine's `device`, read once per device (the launchers' only hardware query). Under
        TRITON_INTERPRET=1 a non-CUDA device is the "interpreter" platform."""
        return _device_spec(torch.device(device))


@functools.lru_cache(maxsize=16)
def _device_spec(device: torch.device) -> DeviceSpec:
    import os

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if torch.version.hip:
            return DeviceSpec("rocm", None, props.name, props.multi_processor_count)
        sm = props.major * 10 + props.minor
        return DeviceSpec("cuda", sm, props.name, props.multi_processor_count, nvidia_driver_version())
    if device.type == "xpu":
        return DeviceSpec("xpu")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return DeviceSpec("interpreter")
    return DeviceSpec("cpu")


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version ("550.54.15"): NVML where installed (a vLLM dependency), else the
    kernel module's /proc file, else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML: try the kernel module
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


# The devices `vllm-wna16 doctor --device` plans for. sm90 is planned as the H200, the GPU whose tuned
# configs and crossovers the plugin ships (an H100 has the same 132 SMs, and no tables of its own).
PLAN_DEVICES = {
    "sm70": DeviceSpec("cuda", 70, None, 80),
    "sm80": DeviceSpec("cuda", 80, None, 108),
    "sm90": DeviceSpec("cuda", 90, "NVIDIA H200", H200_SMS),
    "sm100": DeviceSpec("cuda", 100, None, 148),
    "xpu": DeviceSpec("xpu"),
    "cpu": DeviceSpec("cpu"),
}


@dataclass(frozen=True)
class KernelOptions:
    """The launchers' switches; the defaults are what the measurements below chose.

    use_td: the Triton kernel's tensor descriptors: None = td_gate decides, True = force where it
      compiles, False = pointers (VLLM_TRITON_USE_TD sets it for a layer).
    config_dir: a directory of tuned Triton configs read instead of the shipped ones (configs.CONFIG_DIR;
      bench_moe.py's plugin-triton-alt times candidates side by side with the shipped entries).
    dot_nibbles: how the Triton tl.dot kernel feeds int4 to the tensor cores (fused_moe._dot_form):
      "interleave" one dot over the K tile, nibbles interleaved back into k order; "split" two dots of
      half the K (low nibbles with A's even columns, high with its odd ones); "words" (dequant.
      _word_nibble_dots) B loaded as 32-bit words, one and-or per shift, eight dots of K/8, pointer path
      only; "auto" "words" on K tiles >= 128 ("split" where a tile cannot take words), "interleave" on
      narrower ones. H200, bench/results/h200/2026-12-03-c5ff782-words-forms.md (four shapes x M 8-256):
      on 128/256-wide K tiles "words" took 0.89-0.99x the time of "split" at M 16-64, 0.97-1.02x at M=8;
      on 64-wide tiles "interleave" took 0.92-0.93x of "split" at M=256.
    pair_step_math: how the Triton per-pair (GEMV) kernel multiplies a K step: "fold" (dequant.
      _folded_dot_step: float32 multiply-adds of the raw integers, scale and zero per group; 36% fewer
      instructions per weight in the sm90 SASS) or "tile" (dequantize the tile, then multiply-add). "fold"
      took 0.62-0.85x of "tile" at M <= 8 on all five shapes (2026-12-03-09163a5-lean-forms.md); "tile"
      remains for int4 rows that do not start on a 32-bit word.
    cuda_kernel: "auto" (tensor-core kernel where a weight row splits into 16-byte chunks inside one
      group, else the CUDA-core one), "mma" or "gemv" to force one (tests, benchmarks).
    cuda_stream, cuda_stream_min_pairs_per_warp: decode blocks (<= 8 tokens) on the persistent tensor-core
      kernel (csrc/moe_wna16_stream.cu) where GEMM1 gives each warp of its grid (two blocks of 8 warps per
      SM) at least this many pairs of K steps (cuda_ops.stream_pairs_per_warp); below it the tiled kernel's
      in-block K split is cheaper than units split between warps; False: always the tiled kernel. H200
      2026-12-04-stream2 (layer time stream / tiled): 0.87-0.94 from 6.5 pairs per warp on the small-expert
      shapes, 0.89-1.00 on Mixtral (13.6 and up), but 1.03-1.41 below 6.7.
    cuda_max_block_m: the largest BLOCK_SIZE_M the CUDA layer aligns to (vLLM's rule is min(16, M)): 8-token
      blocks run the kernel's two-tile warps. H200 2026-12-04-bm8a: faster at every M 16-64 on all six
      shapes (Mixtral M=16 355.5 against 487.1 us).
    cuda_ctas_per_sm, cuda_min_warp_steps: the grid the CUDA GEMM's BLOCK_SIZE_N is halved toward, and the
      K steps a warp keeps while it is (cuda_ops.gemm_config). H200 2026-12-04-mma6: four blocks per SM at
      or ahead of two on every shape from M=2 to 64; 8 steps: 16-column blocks the grid alone asked for
      took 10-20% longer on the small-expert shapes at M <= 4.
    own_align: decode batches aligned by the plugin's one-block kernel (csrc/moe_align.cu) instead of vLLM's
      moe_align_block_size: H200 2026-12-04-stream1, vLLM's took 9 us of DeepSeek-V2-Lite's layer at M=8.
    programmatic_launch: the CUDA layer's kernels are programmatic dependent launches on sm90+
      (csrc/grid_dependency.cuh): H200 2026-12-04-pdl3, 1-5 us faster per layer call at M 1-32.
    triton_act_order: how the Triton layer's GEMM1 reads x in an act-order expert's K order: "load" (each A
      load gathers through a_perm), "rows" (one gather of the M * top_k rows first, kernels/triton/act_order.py,
      then GEMM1 reads a row per pair, as the CUDA layer does) or "auto": "rows" from 4 tokens, "load" below
      (configs.act_order_form; H100 2026-12-05-c8ee655-ao2: "load" took 1.2-7.7x the rows form's time at M
      4-256, 0.92-1.01x at M=1).
    swap_ab: the Triton tl.dot tile as C.T = dequant(B) @ A.T (configs.swap_form, dequant._tile_dot):
      None = where the config says so or the rule does (configs.swap_takes_wgmma: 16-64 or 256 token rows and
      >= 64 weight rows), True = every tile of BLOCK_SIZE_M >= 16, False = none. The swapped form is for sm90's
      wgmma, which needs 64 rows of the M operand but takes 8-256 of N: 16-64 routed tokens per expert fit
      N, the weight tile's 64-128 rows fit M. H100 2026-12-05-adcda24-swapfused (six shapes, M 1-1024,
      vLLM 0.34): the layer took 0.84-1.02x the plain tiles' time where the rule swaps, 1.12-1.22x on 32-row
      weight tiles (which it does not swap).
    triton_fuse_act: the Triton layer's GEMM1 computes the gated activation in its epilogue (configs.fuse_form,
      TritonMoEConfig.fuse_act): None = each GEMM1 config's own opinion (False in every shipped table), True =
      every GEMM1 not split along K, False = never. Fused, one program reads the gate and the up rows of its
      columns against one A tile and writes act(gate) * up: one launch fewer per layer call and no (M * top_k,
      2I) intermediate, against half as many programs over N, each with two accumulators. The CUDA layer fuses
      where its tensor-core kernel runs. H100 2026-12-05-adcda24-swapfused (forced at auto's tiles): 0.87-0.98x
      the unfused layer's time at M 1-8 on most shapes, but 1.05-1.06x on the channel-wise shape at M 1-2
      and 1.05-1.29x on most tl.dot tiles from M=8: no rule yet, so nothing fuses by default (the tuners'
      stage B times it per entry against GEMM1 plus the activation kernel).
    """

    use_td: bool | None = None
    config_dir: Path | None = None
    dot_nibbles: str = "auto"
    pair_step_math: str = "fold"
    cuda_kernel: str = "auto"
    cuda_stream: bool = True
    cuda_stream_min_pairs_per_warp: float = 6.0
    cuda_max_block_m: int = 8
    cuda_ctas_per_sm: int = 4
    cuda_min_warp_steps: int = 8
    own_align: bool = True
    programmatic_launch: bool = True
    triton_act_order: str = "auto"
    swap_ab: bool | None = None
    triton_fuse_act: bool | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("use_td", self.use_td),
            ("swap_ab", self.swap_ab),
            ("triton_fuse_act", self.triton_fuse_act),
        ):
            if value not in (None, True, False):
                raise ValueError(f"{name}={value!r} must be None, True or False")
        for name, value, allowed in (
            ("dot_nibbles", self.dot_nibbles, DOT_NIBBLE_FORMS),
            ("pair_step_math", self.pair_step_math, PAIR_STEP_FORMS),
            ("cuda_kernel", self.cuda_kernel, CUDA_KERNELS),
            ("triton_act_order", self.triton_act_order, TRITON_ACT_ORDER_FORMS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
        for name, value in (
            ("cuda_stream", self.cuda_stream),
            ("own_align", self.own_align),
            ("programmatic_launch", self.programmatic_launch),
        ):
            if value is not True and value is not False:  # "no" / "off" are truthy: never read one as True
                raise ValueError(f"{name}={value!r} must be True or False")
        for name, value in (
            ("cuda_max_block_m", self.cuda_max_block_m),
            ("cuda_ctas_per_sm", self.cuda_ctas_per_sm),
            ("cuda_min_warp_steps", self.cuda_min_warp_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an int, not {type(value).__name__}")
        if self.cuda_max_block_m not in (1, 2, 4, 8, 16):
            raise ValueError(f"cuda_max_block_m={self.cuda_max_block_m!r} must be one of 1, 2, 4, 8, 16")
        if self.cuda_ctas_per_sm < 1 or self.cuda_min_warp_steps < 0:
            raise ValueError(
                f"cuda_ctas_per_sm={self.cuda_ctas_per_sm} must be >= 1 and "
                f"cuda_min_warp_steps={self.cuda_min_warp_steps} >= 0"
            )
        per_warp = self.cuda_stream_min_pairs_per_warp
        if isinstance(per_warp, bool) or not isinstance(per_warp, (int, float)) or not per_warp >= 0:
            raise ValueError(f"cuda_stream_min_pairs_per_warp={per_warp!r} must be a number >= 0")  # NaN fails >=


DEFAULT_OPTIONS = KernelOptions()

__all__ = ["DEFAULT_OPTIONS", "DeviceSpec", "KernelOptions", "PLAN_DEVICES"]
