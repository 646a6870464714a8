"""A rank imports megatron-core without compiling: its fused kernels stay plain functions, torch.compile is left as
it was, and inductor's compiler is never imported (about 2 s of every rank's start)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys, torch
compile_ = torch.compile
from scalarlm.training.parallel import import_megatron
import_megatron()
from megatron.core.jit import jit_fuser
from megatron.core.fusions.fused_bias_geglu import geglu
def f(x):
    return x
print(torch.compile is compile_, jit_fuser(f) is f, type(geglu).__name__,
      "torch._inductor.compile_fx" in sys.modules)
"""


def test_megatron_loads_without_compiling_and_torch_compile_is_restored() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True", "function", "False"]
