"""The plugin's own CUDA ops (csrc/, torch.ops.wna16_plus): loading, launch rules, the layer.

`extension_error()` says why the compiled extension is unusable (None when it loads).
`launch_config_error(...)` asks the compiled launch rules (csrc/launch_rules.h) whether the kernel
takes a config; it needs no GPU. `fused_moe_wna16_cuda(...)` runs one MoE layer: the token
alignment (the plugin's one-block kernel for decode batches, else vLLM's moe_align_block_size,
passed in as align_fn), the CUDA GEMM for gate/up with the gated activation fused (tensor-core
kernel; else a separate Triton activation), the CUDA GEMM for down with the router weights, and
the Triton top-k sum. No vLLM import here.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_wna16_plugin.block_config import BlockConfig, choose_cuda_block_config
from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS, PLAN_DEVICES, DeviceSpec, KernelOptions

AlignFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
H200 = PLAN_DEVICES["sm90"]


@functools.cache
def extension_error() -> str | None:
    """None when vllm_wna16_plugin._C loads (registering torch.ops.wna16_plus) and is safe to use, else why not."""
    try:
        import vllm_wna16_plugin._C as ext
    except ImportError as exc:
        if "undefined symbol" in str(exc):  # built, but against another torch than this one
            return (
                f"the plugin's CUDA extension was built against another torch than {torch.__version__} ({exc}); "
                "rebuild it here: pip install --no-build-isolation -e ."
            )
        return (
            f"the plugin's CUDA extension is not built ({exc}); reinstall with a CUDA toolkit: "
            "pip install --no-build-isolation -e ."
        )
    return static_libstdcxx_error(ext.__file__)


FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little-endian: a fatbin container's first word
FATBIN_PTX, FATBIN_ELF = 1, 2


def fatbin_archs(data: bytes) -> list[str]:
    """The code a shared object carries for each GPU architecture: "sm_90" (SASS), "compute_90" (PTX).

    Container header: magic u32, version u16, header size u16 (16), payload size u64; then entries,
    each header (kind u16, u16, header size u32, payload size u64, u32, u32, minor u16, major u16,
    arch u32, ...) followed by its payload. Anything that does not parse is skipped."""
    import struct

    found: set[str] = set()
    pos = data.find(FATBIN_MAGIC)
    while pos != -1:
        if pos + 16 <= len(data):
            _magic, _version, header, size = struct.unpack_from("<IHHQ", data, pos)
            entry, end = pos + header, min(pos + header + size, len(data))
            while header == 16 and entry + 64 <= end:
                kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
                arch = struct.unpack_from("<I", data, entry + 28)[0]
                if kind not in (FATBIN_PTX, FATBIN_ELF) or entry_header < 64 or arch == 0:
                    break
                found.add(f"{'sm' if kind == FATBIN_ELF else 'compute'}_{arch}")
                entry += entry_header + payload
        pos = data.find(FATBIN_MAGIC, pos + 4)
    return sorted(found, key=lambda name: (int(name.rsplit("_", 1)[1]), name))


def extension_archs() -> list[str] | None:
    """fatbin_archs of the built extension, or None when it is not built."""
    try:
        import vllm_wna16_plugin._C as ext
    except ImportError:
        return None
    with open(ext.__file__, "rb") as f:
        return fatbin_archs(f.read())


def static_libstdcxx_error(path: str) -> str | None:
    """Why a built extension must not be used: it carries its own static copy of libstdc++.

    Such a copy's std::ostream crashed the process on the first formatted error message (the GPU
    machine's image, 2026-12-03; docs/gpu-machine.md). setup.py links libstdc++.so.6 by name to
    prevent it; this catches a toolchain that still does it. A shared object that links the
    shared libstdc++ names it in its dynamic string table."""
    with open(path, "rb") as f:
        if b"libstdc++.so.6" in f.read():
            return None
    return (
        f"the plugin's CUDA extension {path} was linked with a static libstdc++ (no libstdc++.so.6 "
        "dependency), whose error messages crash the process; rebuild with a toolchain that links "
        "libstdc++ dynamically (see docs/gpu-machine.md)"
    )


def launch_config_error(size_k: int, num_groups: int, config: BlockConfig, bits: int) -> str:
    """'' when the CUDA kernel takes `config` for reduction size K with num_groups scale groups."""
    if extension_error():
        raise RuntimeError(extension_error())
    return torch.ops.wna16_plus.check_launch_config(
        size_k, num_groups, config.block_size_m, config.block_size_n, config.block_size_k, bits
    )


def group_major(table: torch.Tensor | None) -> torch.Tensor | None:
    """A per-(row, group) table (scales (E, N, G) or qzeros (E, N*bits/8, G)) with the rows of one group
    adjacent in memory: the (E, N, G) view of a contiguous (E, G, N) copy. The CUDA kernel takes either
    layout. In this one the scales of a warp step (16 rows, one group) are one 32-byte run instead of 16
    scattered words, which takes that many shared-memory copy requests off the kernel's load path (the
    L1 was its busiest unit, ncu at Mixtral M=1/8). Costs one copy of the table (E*N*G values)."""
    if table is None:
        return None
    return table.transpose(1, 2).contiguous().transpose(1, 2)


# The grid BLOCK_SIZE_N is halved toward: KernelOptions.cuda_ctas_per_sm blocks per SM (4 on an H200,
# 2026-12-04-mma6: at or ahead of two per SM on every shape from M=2 to 64, by up to 20% on Mixtral's M 2-8;
# two per SM ended in a partial second wave of long blocks there). Past half a block per SM, halving stops
# where a warp's K slice would drop below KernelOptions.cuda_min_warp_steps K steps (8): it is then mostly
# pipeline fill and the K-split sum (same run: on the small-expert shapes at M <= 4 the 16-column blocks
# that the grid alone asked for took 10-20% longer). Below that grid (K=1344 at M <= 16: 16-64 blocks)
# the grid wins regardless (16.3 against 25.9 us at M=1).
# The largest BLOCK_SIZE_M the layer aligns to is KernelOptions.cuda_max_block_m (8; vLLM's rule is
# min(16, M)): blocks of <= 8 tokens run the kernel's two-tile warps (one 8-token column tile).


# Per warp of the stream kernel's workspace: two float32 partial sums of a unit and an int32 counter
# (csrc/launch_rules.h kStreamSlotWords); a launch uses at most two blocks of 8 warps per SM, one slot each,
# plus one.
STREAM_SLOT_WORDS = 513
_workspaces: dict[int, torch.Tensor] = {}


def stream_workspace(device: torch.device) -> torch.Tensor:
    """The stream kernel's workspace on `device`: created zero (its counters must be; every launch leaves
    them zero), once per device, on first use (the backend's prepare, outside any CUDA-graph capture). The
    launches that share it must not overlap: one stream per device, as vLLM runs its MoE layers."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _workspaces:
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        slots = 2 * sms * 8 + 1
        _workspaces[index] = torch.zeros(slots * STREAM_SLOT_WORDS, dtype=torch.float32, device=f"cuda:{index}")
    return _workspaces[index]


# The plugin's one-block alignment (csrc/moe_align.cu, KernelOptions.own_align) takes decode batches of
# int32 ids: at most this many routed pairs (its shared memory holds 2 counts per expert, up to 4096 experts).
ALIGN_MAX_PAIRS = 4096
ALIGN_MAX_EXPERTS = 4096


def align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None,
    align_fn: AlignFn,
    programmatic: bool = False,
    own: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts=True):
    (sorted_token_ids, expert_ids, num_tokens_post_padded), the plugin's own kernel for decode batches of
    int32 ids (own: CudaLaunch.own_align), else align_fn (vLLM's). The lists are as long as vLLM makes them.
    programmatic: the plugin's kernel is a programmatic dependent launch (KernelOptions.programmatic_launch)."""
    pairs = topk_ids.numel()
    own = own and topk_ids.dtype == torch.int32 and pairs <= ALIGN_MAX_PAIRS and num_experts <= ALIGN_MAX_EXPERTS
    if not own:
        return align_fn(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts=True)
    longest = min(pairs * block_size, pairs + num_experts * (block_size - 1))
    sorted_ids = torch.empty(longest, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(-(-longest // block_size), dtype=torch.int32, device=topk_ids.device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    refusal = torch.ops.wna16_plus.moe_align_block_size(
        topk_ids.contiguous(), block_size, num_experts, expert_map, sorted_ids, expert_ids, num_post_pad, programmatic
    )
    if refusal:
        raise RuntimeError(f"wna16_plus::moe_align_block_size: {refusal}")
    return sorted_ids, expert_ids, num_post_pad


def expected_blocks(m: int, top_k: int, num_experts: int, block_m: int) -> float:
    """Expert blocks of block_m pairs the alignment is expected to make for m tokens (uniform routing)."""
    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit

    pairs = m * top_k
    hit = expected_experts_hit(pairs, num_experts)
    return pairs if block_m == 1 else hit * math.ceil(pairs / hit / block_m)


def stream_pairs_per_warp(
    m: int, top_k: int, num_experts: int, size_k: int, out_n: int, bits: int, gated: bool, block_m: int, sms: int
) -> float:
    """Pairs of K steps (128 bytes of 32 weight rows) each warp of the stream kernel's grid (2 blocks of 8
    warps per SM) is expected to stream for one GEMM: the kernel's split of the work, mirrored."""
    units = -(-out_n // (16 if gated else 32))
    k_pairs = math.ceil(math.ceil(size_k * bits / 128) / 8)
    return expected_blocks(m, top_k, num_experts, block_m) * units * k_pairs / (16 * sms)


def warp_k_steps(size_k: int, bits: int, block_m: int, block_n: int, gated: bool) -> int:
    """K steps (4 chunks of 16 bytes of a weight row) each warp of the mma kernel streams for one block:
    the kernel's own work split (csrc/moe_wna16_mma.cu), mirrored. A 16-row tile is 16 output columns
    (8 when gated); a warp takes 2 tiles at once for blocks of <= 8 tokens (on GPUs where two blocks of
    that ring fit an SM, e.g. Hopper; elsewhere 1, which this estimate does not model); 8 warps split
    K, in pairs of steps, when the block has fewer units than warps."""
    tiles = -(-block_n // (8 if gated else 16))
    per_warp = 2 if block_m <= 8 and tiles >= 2 else 1
    ksplit = 8 // min(-(-tiles // per_warp), 8)
    chunks = -(-size_k * bits // 128)
    pairs = -(-chunks // 8)  # the warps are dealt pairs of steps (128 bytes of a row)
    return 2 * -(-pairs // ksplit)


def pick_vector_bytes(size_k: int, num_groups: int, bits: int) -> int:
    """csrc/launch_rules.h pick_vector_bytes, mirrored (tests compare the two): the widest of 16/8/4 bytes that
    divides a weight row and keeps each vector inside one scale group; 0 = none fits."""
    row_bytes = size_k * bits // 8
    group_size = size_k // num_groups if num_groups > 0 else 0
    for vec in (16, 8, 4):
        if row_bytes % vec == 0 and (num_groups == 1 or group_size % (vec * 8 // bits) == 0):
            return vec
    return 0


def mma_kernel_fits(size_k: int, num_groups: int, bits: int) -> bool:
    """csrc/launch_rules.h mma_kernel_fits, mirrored (tests compare the two on every shape they sweep): the
    tensor-core kernel reads 16-byte chunks of a row that never straddle a group, a power-of-two number of
    chunks per group (or one group)."""
    if pick_vector_bytes(size_k, num_groups, bits) != 16:
        return False
    chunks = size_k * bits // 128 // num_groups
    return num_groups == 1 or (chunks & (chunks - 1)) == 0


def gemm_config(
    m: int,
    top_k: int,
    num_experts: int,
    size_k: int,
    size_n: int,
    num_groups: int,
    bits: int,
    gated: bool = False,
    device: DeviceSpec = H200,
    options: KernelOptions = DEFAULT_OPTIONS,
):
    """The launch config of one GEMM: block_config's legal CUDA config (channel-wise as one group of K),
    BLOCK_SIZE_M capped at options.cuda_max_block_m, with BLOCK_SIZE_N halved (down to 16) while the expected
    grid has fewer than options.cuda_ctas_per_sm * SMs blocks and, once it has half a block per SM, each warp
    keeps at least options.cuda_min_warp_steps K steps. The kernel takes any BLOCK_SIZE_N, so the smaller
    tile stays legal; decode grids are otherwise a few dozen blocks. size_n: output columns (I when the
    activation is fused, gated)."""
    # channel-wise is one group of K: legal for any K % 8 == 0 (K=176 is 704 at TP4), unlike vLLM's kernel
    cfg = choose_cuda_block_config(m, top_k, num_experts, size_k, size_n, size_k // num_groups, bits)
    bm = min(cfg.block_size_m, options.cuda_max_block_m)
    m_blocks = expected_blocks(m, top_k, num_experts, bm)
    min_ctas, min_blocks = options.cuda_ctas_per_sm * device.sm_count, device.sm_count // 2
    bn = cfg.block_size_n
    while bn > 16 and (blocks := m_blocks * -(-size_n // bn)) < min_ctas:
        if blocks >= min_blocks and warp_k_steps(size_k, bits, bm, bn // 2, gated) < options.cuda_min_warp_steps:
            break
        bn //= 2
    return BlockConfig(bm, bn, cfg.block_size_k, cfg.size_k, cfg.group_size)


@dataclass(frozen=True)
class CudaLaunch:
    """The CUDA layer's launch for one batch size (cuda_launch): both GEMMs' configs and kernels, how the
    tokens are aligned and whether the launches are programmatic.

    kernel1 / kernel2: "auto" | "mma" | "gemv" | "stream" (invoke_moe_wna16_gemm); fuse_activation: GEMM1
    runs the gated activation (tensor-core kernel only); own_align: the plugin's one-block alignment when
    the ids are int32 (else vLLM's); pairs_per_warp: the stream rule's measure of GEMM1."""

    gemm1: BlockConfig
    gemm2: BlockConfig
    fuse_activation: bool
    kernel1: str
    kernel2: str
    own_align: bool
    programmatic: bool
    pairs_per_warp: float


@functools.lru_cache(maxsize=4096)
def cuda_launch(
    m: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
    groups1: int,
    groups2: int,
    bits: int,
    global_num_experts: int,
    device: DeviceSpec = H200,
    options: KernelOptions = DEFAULT_OPTIONS,
) -> CudaLaunch:
    """What fused_moe_wna16_cuda launches for m tokens: pure and GPU-blind (the launch plan shows it).

    GEMM1 fuses the activation where the tensor-core kernel takes it (mma_kernel_fits); both GEMMs share
    one alignment (GEMM1's BLOCK_SIZE_M). Decode blocks (<= 8 tokens) run the stream kernel when
    options.cuda_stream and GEMM1 gives each warp >= options.cuda_stream_min_pairs_per_warp pairs of K steps
    (a GEMM the tensor-core kernel does not fit keeps options.cuda_kernel)."""
    kernel = options.cuda_kernel
    fuse = kernel != "gemv" and mma_kernel_fits(hidden, groups1, bits)
    n1 = inter if fuse else 2 * inter
    cfg1 = gemm_config(m, top_k, num_experts, hidden, n1, groups1, bits, fuse, device, options)
    cfg2 = gemm_config(m, top_k, num_experts, inter, hidden, groups2, bits, False, device, options)
    if cfg2.block_size_m != cfg1.block_size_m:  # one alignment for both GEMMs
        cfg2 = BlockConfig(cfg1.block_size_m, cfg2.block_size_n, cfg2.block_size_k, cfg2.size_k, cfg2.group_size)
    per_warp = stream_pairs_per_warp(m, top_k, num_experts, hidden, n1, bits, fuse, cfg1.block_size_m, device.sm_count)
    streams = (
        kernel == "auto"
        and options.cuda_stream
        and cfg1.block_size_m <= 8
        and per_warp >= options.cuda_stream_min_pairs_per_warp
    )
    pairs = m * top_k
    return CudaLaunch(
        gemm1=cfg1,
        gemm2=cfg2,
        fuse_activation=fuse,
        kernel1="stream" if streams and fuse else kernel,
        kernel2="stream" if streams and mma_kernel_fits(inter, groups2, bits) else kernel,
        own_align=options.own_align and pairs <= ALIGN_MAX_PAIRS and global_num_experts <= ALIGN_MAX_EXPERTS,
        programmatic=options.programmatic_launch and device.platform == "cuda" and device.sm_major >= 9,
        pairs_per_warp=per_warp,
    )


def invoke_moe_wna16_gemm(
    a: torch.Tensor,  # (rows, K) bf16/fp16
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    scales: torch.Tensor,  # (E, N, G) a.dtype
    qzeros: torch.Tensor | None,  # (E, N*bits/8, G) uint8
    c: torch.Tensor,  # (num_pairs, N) a.dtype; rows of pairs the alignment skips are left as they are
    topk_weights: torch.Tensor | None,  # (num_pairs,) float32: multiplies row p when given
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    *,
    bits: int,
    top_k: int,  # the A row of pair p is p // top_k
    config: BlockConfig,
    kernel: str = "auto",
    activation: str = "none",
    programmatic: bool = False,
    weights_before_wait: bool = False,
) -> torch.Tensor:
    """One grouped GEMM on torch.ops.wna16_plus.moe_wna16_gemm; the op checks every argument first.

    kernel: "auto" (the tensor-core kernel wherever a weight row splits into 16-byte chunks inside
    one scale group, else the CUDA-core one), or "mma" / "gemv" to force one (tests, benchmarks), or
    "stream": the tensor-core kernel's persistent form (BLOCK_SIZE_M <= 8; BLOCK_SIZE_N unused), on
    stream_workspace(a.device).
    activation: "silu" / "gelu" fuses the gated activation (mma kernel only): rows n and N/2 + n of
    qweight are gate and up of output column n, and c is (num_pairs, N/2).
    programmatic: a programmatic dependent launch (csrc/moe_wna16_gemm.cu); weights_before_wait says that the
    routing lists were written two or more kernels back, without which the stream kernel is launched plainly."""
    # the op returns its refusal instead of throwing (no C++ exception leaves the library; csrc/moe_wna16_gemm.cu)
    refusal = torch.ops.wna16_plus.moe_wna16_gemm(
        a, qweight, scales, qzeros, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, c,
        bits, top_k, config.block_size_m, config.block_size_n, config.block_size_k, kernel, activation,
        stream_workspace(a.device) if kernel == "stream" else None, programmatic, weights_before_wait,
    )  # fmt: skip
    if refusal:
        raise RuntimeError(f"wna16_plus::moe_wna16_gemm: {refusal}")
    return c


# Routed pairs gathered per step by act_order_rows: its int64 index is this many rows of H (58 MB at H=7168),
# whatever the batch; the gathered rows themselves are the (M*top_k, H) activations GEMM1 reads.
ACT_ORDER_GATHER_PAIRS = 1024


def act_order_rows(
    a: torch.Tensor, a_perm: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """(M*top_k, H): row p is token p // top_k's row of `a` with its columns in the K order of pair p's expert,
    a[p // top_k, a_perm[e_p]] (a pair routed off this rank reads expert 0's order; the alignment skips it).
    One Triton launch on a GPU or under Triton's interpreter (kernels/triton/act_order.py), else the torch
    form (act_order_rows_torch)."""
    if a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from vllm_wna16_plugin.kernels.triton.act_order import act_order_rows_triton

        return act_order_rows_triton(a, a_perm, topk_ids, expert_map)
    return act_order_rows_torch(a, a_perm, topk_ids, expert_map)


def act_order_rows_torch(
    a: torch.Tensor, a_perm: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """act_order_rows in torch ops, ACT_ORDER_GATHER_PAIRS pairs at a time (a bounded int64 index); no host
    sync, CUDA-graph capturable, eight launches (the form before 2026-12-05's measurement)."""
    m, top_k = topk_ids.shape
    # vLLM's padding pairs (id -1, never an index into the map) and other ranks' experts (map -1) gather
    # expert 0's order, as the Triton kernel does: the GEMMs skip those pairs
    ids = topk_ids.reshape(-1).long()
    local = ids
    if expert_map is not None:
        local = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], 0)
    local = local.clamp(min=0)
    tokens = torch.arange(m * top_k, device=a.device) // top_k
    out = torch.empty(m * top_k, a.shape[1], dtype=a.dtype, device=a.device)
    for lo in range(0, m * top_k, ACT_ORDER_GATHER_PAIRS):
        hi = min(lo + ACT_ORDER_GATHER_PAIRS, m * top_k)
        torch.gather(a.index_select(0, tokens[lo:hi]), 1, a_perm.index_select(0, local[lo:hi]).long(), out=out[lo:hi])
    return out


def fused_moe_wna16_cuda(
    x: torch.Tensor,  # (M, H) bf16/fp16
    w13_qweight: torch.Tensor,  # (E, 2I, H*bits/8) uint8
    w2_qweight: torch.Tensor,  # (E, H, I*bits/8) uint8
    w13_scales: torch.Tensor,  # (E, 2I, G1)
    w2_scales: torch.Tensor,  # (E, H, G2)
    topk_weights: torch.Tensor,  # (M, top_k)
    topk_ids: torch.Tensor,  # (M, top_k) global expert ids
    *,
    bits: int,
    align_fn: AlignFn,
    w13_qzeros: torch.Tensor | None = None,
    w2_qzeros: torch.Tensor | None = None,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int = -1,
    options: KernelOptions = DEFAULT_OPTIONS,
    launch: CudaLaunch | None = None,
    a_perm: torch.Tensor | None = None,  # (E, H) int32: act order (backends.base.sort_act_order)
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j]; the reference's contract.

    align_fn: vLLM's moe_align_block_size(topk_ids, block_size, num_experts, expert_map,
    ignore_invalid_experts=True), for batches the plugin's own alignment does not take (align_block_size).
    launch: what to launch (the layer's launch plan passes it); None: cuda_launch for this batch, this
    device and `options`.
    a_perm: act order in the sorted layout (backends.base.sort_act_order: every scale group one contiguous
    K run, GEMM2's K order already in the weights): K row k of expert e is x's column a_perm[e, k]. One
    gather gives each routed pair its own row of x in its expert's K order (M*top_k rows of H), and GEMM1
    reads A by pair, as GEMM2 always does.
    """
    from vllm_wna16_plugin.kernels.triton.activation import gated_activation_triton, moe_sum_triton

    if extension_error():
        raise RuntimeError(extension_error())
    m, top_k = topk_ids.shape
    num_experts, two_i, _ = w13_qweight.shape
    hidden, inter = x.shape[1], two_i // 2
    if global_num_experts == -1:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    # ids are not range-checked here (a host sync per call): ops.fused_moe_wna16 checks them (inputs.py),
    # and inside the layer vLLM's router produced them
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()  # read as ptr + pair
    expert_map = None if expert_map is None else expert_map.contiguous()
    out = torch.empty_like(x)
    if m == 0:
        return out
    if launch is None:
        launch = cuda_launch(m, top_k, num_experts, hidden, inter, w13_scales.shape[-1], w2_scales.shape[-1],
                             bits, global_num_experts, DeviceSpec.of(x.device), options)  # fmt: skip
    cfg1, cfg2, pdl = launch.gemm1, launch.gemm2, launch.programmatic
    sorted_ids, expert_ids, num_post_pad = align_block_size(
        topk_ids, cfg1.block_size_m, global_num_experts, expert_map, align_fn, pdl, launch.own_align
    )
    # the kernel reads A rows in 16-byte vectors: a fresh copy when x's rows are not 16-byte aligned
    a = (
        x
        if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
        else x.clone(memory_format=torch.contiguous_format)
    )
    weights = topk_weights.reshape(-1).float()
    if apply_router_weight_on_input:
        a = (a.float() * topk_weights.float().reshape(m, 1)).to(x.dtype)  # top_k == 1 (checked by the caller)
    a_rows_per_token = top_k  # GEMM1 reads A row p // top_k for pair p
    if a_perm is not None:
        a, a_rows_per_token = act_order_rows(a, a_perm, topk_ids, expert_map), 1
    gemm = functools.partial(invoke_moe_wna16_gemm, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                             num_tokens_post_padded=num_post_pad, bits=bits, programmatic=pdl)  # fmt: skip
    if launch.fuse_activation:
        act = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)
        gemm(a, w13_qweight, w13_scales, w13_qzeros, act, None, top_k=a_rows_per_token, config=cfg1,
             activation=activation, kernel=launch.kernel1)  # fmt: skip
    else:
        h1 = torch.empty(m * top_k, two_i, dtype=x.dtype, device=x.device)
        gemm(
            a, w13_qweight, w13_scales, w13_qzeros, h1, None, top_k=a_rows_per_token, config=cfg1, kernel=launch.kernel1
        )
        act = gated_activation_triton(h1, activation)
    # rows of pairs the alignment skips (experts of other ranks, with an expert_map) stay unwritten in
    # act and h2; their h2 rows must add 0 in the top-k sum, so h2 then starts as zeros
    h2 = (torch.empty if expert_map is None else torch.zeros)(m * top_k, hidden, dtype=x.dtype, device=x.device)
    # GEMM2's routing lists are the alignment's: two or more kernels back
    gemm(act, w2_qweight, w2_scales, w2_qzeros, h2, None if apply_router_weight_on_input else weights,
         top_k=1, config=cfg2, kernel=launch.kernel2, weights_before_wait=True)  # fmt: skip
    return moe_sum_triton(h2, out, top_k, programmatic=pdl)


__all__ = [
    "CudaLaunch",
    "act_order_rows",
    "act_order_rows_torch",
    "cuda_launch",
    "extension_error",
    "mma_kernel_fits",
    "fused_moe_wna16_cuda",
    "gemm_config",
    "group_major",
    "invoke_moe_wna16_gemm",
    "align_block_size",
    "launch_config_error",
    "stream_workspace",
]
