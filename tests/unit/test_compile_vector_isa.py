"""train.compile under an overridden ATEN_CPU_CAPABILITY: Inductor generates its CPU kernels for the ISA that names,
but torch's FX graph cache key leaves the ISA out, so a run on another code path reused kernels written for the
native one and left half of every vector unwritten (NaN at step 1 under ATEN_CPU_CAPABILITY=avx2 on an AVX-512
CPU). inductor_isa.pin_cpu_vector_isa puts the ISA's width into the key (Inductor's cpp.simdlen); the cache itself
is exercised across two processes in tests/dist/test_compile_cache_isa.py (picking the ISA runs the compiler)."""

from __future__ import annotations

import pytest
from torch._inductor import config as inductor_config

from trainctl.train.inductor_isa import pin_cpu_vector_isa

pytestmark = pytest.mark.unit


def test_a_width_the_user_set_is_kept():
    with inductor_config.patch({"cpp.simdlen": 0}):  # 0: no vector ISA, scalar kernels
        pin_cpu_vector_isa()
        assert inductor_config.cpp.simdlen == 0
