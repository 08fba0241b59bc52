"""Inductor's CPU kernels and the vector ISA they are written for.

Inductor picks the ISA from ATEN_CPU_CAPABILITY when set (else the widest the CPU has) and writes its CPU kernels'
loops for that width, but torch 2.13's FX graph cache key leaves the pick out; only cpp.simdlen is in it. Two
processes on other code paths (or two CPUs sharing a cache folder) then share entries: kernels written for 16
AVX-512 float lanes built with AVX2's 8 leave half of every vector unwritten (NaN at the first step), and kernels
written for AVX2's 8 lanes built with AVX-512's 16 write past their buffers (glibc aborts the process: double free
or corruption). Every torch.compile trainctl makes on CPU (train.compile's blocks, torchao's low-bit optimizer
step) pins the width first.
"""

from __future__ import annotations


def pin_cpu_vector_isa() -> None:
    """Put the vector ISA Inductor generates CPU kernels for into its cache key: cpp.simdlen = the picked ISA's width.

    With simdlen set, each ISA has its own cache entries; a width picks the same ISA as the capability did. Picking
    runs the C++ compiler once per process (a few seconds), so only a process about to compile calls this.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if inductor_config.cpp.simdlen is None:  # set by the user: theirs is already in the key
        inductor_config.cpp.simdlen = pick_vec_isa().bit_width()
