"""Compile the Triton kernels for a Hopper GPU (sm_90) on this GPU-less machine.

The interpreter checks what the kernels compute but not that they compile: a GPU-only type
error, an illegal ``tl.dot`` shape, or a layout the compiler rejects would only show on real
hardware. Triton compiles ahead of time for an explicit target with the ``ptxas`` it ships,
so these tests build the cubins, and check the properties the bandwidth target depends on:
K/V loads are asynchronous 16-byte copies (software-pipelined), the score and P·V dots use
bf16 tensor-core MMAs, and no registers spill. Argument specialisation mimics a launch with
16-aligned pointers and strides (D a multiple of 16), as Triton's JIT would see it.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")

from treeattn.kernels.dispatch import interpreter_enabled  # noqa: E402

pytestmark = pytest.mark.skipif(
    interpreter_enabled(), reason="Triton runs interpreted in this process: nothing to compile"
)

FLOAT_ARGS = {"qk_scale_log2"}
SCALAR_TY = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _compile(fn, pointer_types, constexprs, divisible, num_warps: int, stages: int):
    """Compile ``fn`` for sm_90; ``divisible`` names the int args Triton would see as 16k."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointer_types.get(name, "fp32" if name in FLOAT_ARGS else "i32")
        if name in pointer_types or name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": stages},
    )


def _partial(dtype: str, d: int, block_n: int, has_kv_len: bool, stages: int = 3):
    from treeattn.kernels import triton_partial as tp

    ptr = SCALAR_TY[dtype]
    types = {"Q": ptr, "K": ptr, "V": ptr, "KV_LEN": "*i64", "O_SPLIT": "*fp32",
             "LSE_SPLIT": "*fp32"}  # fmt: skip
    const = {"G": 4, "G_PAD": 16, "D": d, "D_PAD": triton.next_power_of_2(d),
             "BLOCK_N": block_n, "HAS_KV_LEN": has_kv_len, "UPCAST": dtype == "fp32"}  # fmt: skip
    strides = {n for n in tp._partial_split_kernel.arg_names if n.startswith("stride_")}
    return _compile(tp._partial_split_kernel, types, const, strides | {"TOKENS_PER_SPLIT"},
                    num_warps=4, stages=stages)  # fmt: skip


def _spills(kernel) -> tuple[int, int]:
    """(registers, local-memory bytes) of the kernel's cubin, from the bundled cuobjdump."""
    import subprocess
    import tempfile

    tool = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this Triton wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    assert regs and local, out
    return int(regs.group(1)), int(local.group(1))


def test_bf16_partial_kernel_is_pipelined_and_uses_tensor_cores():
    kernel = _partial("bf16", 128, 64, has_kv_len=True)
    ptx = kernel.asm["ptx"]
    assert re.search(r"cp\.async\.cg\.shared\.global[^\n]*0x10", ptx), "K/V loads not async 16B"
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    regs, local = _spills(kernel)
    assert local == 0 and regs <= 255


def test_fp32_partial_kernel_with_padded_head_dim_compiles():
    # D=80 pads to 128 with masks on D; fp32 uses IEEE dots (no TF32 rounding of the inputs).
    kernel = _partial("fp32", 80, 32, has_kv_len=True)
    assert "mma.sync" not in kernel.asm["ptx"] or "tf32" not in kernel.asm["ptx"]
    assert _spills(kernel)[1] == 0


def test_merge_kernel_compiles():
    from treeattn.kernels import triton_merge as tm

    types = {"O_IN": "*fp32", "LSE_IN": "*fp32", "O_OUT": "*fp32", "LSE_OUT": "*fp32"}
    const = {"D": 128, "D_PAD": 128, "BLOCK_S": 64}
    divisible = {"stride_in", "stride_ib", "stride_ih", "stride_ob", "stride_oh"}
    kernel = _compile(tm._merge_kernel, types, const, divisible, num_warps=4, stages=1)
    assert _spills(kernel)[1] == 0
