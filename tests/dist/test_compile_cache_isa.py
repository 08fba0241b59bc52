"""Inductor's on-disk cache shared by two code paths: a native run fills it, a run under ATEN_CPU_CAPABILITY=avx2
reads it. Inductor writes CPU kernels' loops for the vector ISA it picks, and torch's FX graph cache key leaves that
pick out: without inductor_isa.pin_cpu_vector_isa the avx2 process reused kernels written for 16 AVX-512 float lanes,
built them with AVX2's 8-lane flags, and left half of every vector unwritten (NaN at the first training step); the
other way round the native process wrote past its buffers and aborted (double free or corruption).
Each side is its own process, as each run is: the cache on disk is what they share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch._inductor.cpu_vec_isa import valid_vec_isa_list

WIDTHS = {isa.bit_width() for isa in valid_vec_isa_list()}

# One compiled pointwise kernel, long enough for the vector loop; x * 2 + 1 is exact in fp32, so compiled and eager
# agree bitwise and any unwritten lane shows.
CHILD = """
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from trainctl.train.inductor_isa import pin_cpu_vector_isa
picked = str(pick_vec_isa())
pin_cpu_vector_isa()
assert str(pick_vec_isa()) == picked, (picked, str(pick_vec_isa()))  # the width picks what the capability did
x = torch.arange(4096, dtype=torch.float32) / 7 - {offset}
out = torch.compile(lambda t: t * 2 + 1)(x)
bad = (out != x * 2 + 1).sum().item()
print("elements unwritten or wrong:", bad)
raise SystemExit(bad != 0)
"""


def compile_in_child(cache_dir, capability, offset):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    code = CHILD.format(offset=offset)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two cold compiles each
@pytest.mark.skipif(not (256 in WIDTHS and max(WIDTHS) > 256), reason="needs a CPU with a vector ISA wider than AVX2")
@pytest.mark.parametrize("order", [(None, "avx2"), ("avx2", None)], ids=["native-then-avx2", "avx2-then-native"])
def test_a_cache_filled_on_one_path_serves_the_other_right(tmp_path, order):
    """Native first: unpinned, the avx2 process left half of every vector unwritten. avx2 first: unpinned, the
    native process wrote past its buffers (glibc: double free or corruption, abort)."""
    for capability, offset in zip(order, (3, 5), strict=True):  # another input: no stale buffer can hold the answer
        proc = compile_in_child(tmp_path, capability, offset)
        assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}: {proc.stdout}{proc.stderr[-2000:]}"
