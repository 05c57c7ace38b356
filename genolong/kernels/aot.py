"""Compile-only builds of the Triton kernels for a GPU architecture, on a machine without a GPU
(the CPU build check of tests/kernels).

Triton's JIT compiles a kernel for the arguments of each launch: a pointer or an integer that is a
multiple of 16 is marked so (`tt.divisibility` 16) and an integer equal to 1 becomes a constant.
The marking decides how loads compile: with aligned pointers and strides, the loads inside a
software-pipelined loop become asynchronous copies staged in shared memory, one buffer per stage.
A build without it under-states the shared memory a launch needs (the indexer v2's first pass:
51,200 bytes built bare, 297,984 asked for on the H200). `build` marks the arguments with
Triton's own specialisation function, so its `metadata.shared` is what the GPU would ask for.
"""

from __future__ import annotations

# Shared memory one block may opt into on sm_90 (H100 / H200): 227 KiB, Triton's "Hardware limit".
SM90_SHARED_BYTES = 232_448


def specialise(fn, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `fn` for a launch with `args`, as the JIT derives them.

    args maps every runtime parameter to its integer value at the launch, or to a type: a pointer
    type ("*bf16") stands for a torch allocation (16-byte aligned), "i32" / "i64" for an integer
    taken as a multiple of 16 (lengths and strides at the model's shapes; also the most
    specialised build, the one with the most asynchronous copies), "fp32" for a float. The
    kernel's do_not_specialize lists are honoured.
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    stand_in = {"i32": 16, "i64": 1 << 36}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            continue
        value = stand_in.get(args[param.name], args[param.name])
        if isinstance(value, str):
            specialised = value.startswith("*") and not (param.do_not_specialize or param.do_not_specialize_on_alignment)
            kind, attr = value, "D" if specialised else None
        else:
            kind, attr = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            constexprs[param.name] = value
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
        signature[param.name] = kind
    return signature, constexprs, attrs


def build(fn, args: dict, constexprs: dict, *, num_warps: int, num_stages: int | None = None, arch: int = 90):
    """`fn` compiled for sm_`arch` as the JIT compiles a launch with `args` (see `specialise`) and
    the constexpr values `constexprs`; `num_stages` None keeps Triton's default."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, specialised, attrs = specialise(fn, args)
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    source = ASTSource(fn, signature, {**specialised, **constexprs}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_usage(kernel, arch: int = 90) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of a built kernel, from ptxas -v on its PTX."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", log).group(1)), int(re.search(r"(\d+) bytes spill stores", log).group(1))
