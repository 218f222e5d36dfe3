"""Does Triton's automatic warp specialisation (`tl.range(..., warp_specialize=True)`) take a WNA16 K loop on sm90?

Compile-only, no GPU: each form below is one K loop of a 128x128x64 tile (4 warps, 3 stages) compiled for
sm90a by the installed Triton, with and without `warp_specialize`. A form "takes" it when the compiled TTGIR holds a
`ttg.warp_specialize` op (producer and consumer partitions); "fails" when Triton's pass pipeline raises.

    python bench/ws_probe.py            # a table: form, plain compile, warp-specialised compile

Forms (FORMS): the control (bf16 A and B by TMA); int8 B by TMA, dequantised by one convert; int4 B by TMA with
the nibbles interleaved (join + reshape), alone and times group scales (by TMA or by pointer), or split into two
half-K dots (SPLIT_NIBBLES); and the control with A by pointer loads, as the MoE kernel reads its sorted token
rows on sm90 (TMA's row gather, gather4, is sm100+). docs/perf/triton-kernel.md has the result.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FORMS = {
    "bf16 A and B by TMA (control)": 0,
    "int8 B by TMA, one convert": 2,
    "int4 B by TMA, nibbles interleaved (join + reshape)": 1,
    "int4 interleaved, group scales by TMA": 3,
    "int4 interleaved, group scales by pointer": 4,
    "int4 split nibbles: two half-K dots, no scales": 5,
    "bf16, A by pointer loads (the MoE's sorted rows)": 6,
}


@triton.jit
def _loop(a_ptr, b_ptr, c_ptr, s_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          WS: tl.constexpr, FORM: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    a_half = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK // 2])
    s_desc = tl.make_tensor_descriptor(s_ptr, shape=[K // BK, N], strides=[N, 1], block_shape=[1, BN])
    if FORM == 0 or FORM == 6:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    elif FORM == 2:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K // 2], strides=[K // 2, 1], block_shape=[BN, BK // 2])
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K // BK, warp_specialize=WS):
        if FORM == 5:
            bq = b_desc.load([pid_n * BN, k * BK // 2])
            acc = tl.dot(a_half.load([pid_m * BM, k * BK]), ((bq & 0xF).to(tl.bfloat16) - 8.0).T, acc)
            acc = tl.dot(a_half.load([pid_m * BM, k * BK + BK // 2]), ((bq >> 4).to(tl.bfloat16) - 8.0).T, acc)
        else:
            if FORM == 6:
                a = tl.load(a_ptr + offs_m[:, None] * K + k * BK + offs_k[None, :])
            else:
                a = a_desc.load([pid_m * BM, k * BK])
            if FORM == 0 or FORM == 6:
                b = b_desc.load([pid_n * BN, k * BK])
            elif FORM == 2:
                b = b_desc.load([pid_n * BN, k * BK]).to(tl.bfloat16) - 128.0
            else:
                bq = b_desc.load([pid_n * BN, k * BK // 2])
                b = tl.join((bq & 0xF).to(tl.bfloat16) - 8.0, (bq >> 4).to(tl.bfloat16) - 8.0).reshape(BN, BK)
                if FORM == 3:
                    b = b * s_desc.load([k, pid_n * BN]).reshape(BN)[:, None]
                elif FORM == 4:
                    b = b * tl.load(s_ptr + k * N + pid_n * BN + tl.arange(0, BN))[:, None]
            acc = tl.dot(a, b.T, acc)
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


def compile_form(form: int, ws: bool, sm: int = 90) -> str:
    """'plain, W warps' / 'specialised, W warps' / 'fails: <first line>' for one form."""
    sig = dict(a_ptr="*bf16", b_ptr="*bf16" if form in (0, 6) else "*u8", c_ptr="*bf16", s_ptr="*bf16",
               M="i32", N="i32", K="i32", BM="constexpr", BN="constexpr", BK="constexpr", WS="constexpr",
               FORM="constexpr")  # fmt: skip
    consts = dict(BM=128, BN=128, BK=64, WS=ws, FORM=form)
    src = ASTSource(
        fn=_loop, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in range(7)}
    )
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=dict(num_warps=4, num_stages=3))
    except Exception as exc:  # Triton's pass pipeline refusing the loop
        return "fails: " + (str(exc).strip().splitlines() or ["?"])[-1][:60]
    kind = "specialised" if "ttg.warp_specialize" in compiled.asm["ttgir"] else "plain"
    return f"{kind}, {compiled.metadata.num_warps} warps"


def main() -> None:
    print(f"Triton {triton.__version__}, sm90a, 128x128x64 tile, 4 warps, 3 stages")
    print("| form | without warp_specialize | with |\n| --- | --- | --- |")
    for name, form in FORMS.items():
        print(f"| {name} | {compile_form(form, False)} | {compile_form(form, True)} |", flush=True)


if __name__ == "__main__":
    main()
