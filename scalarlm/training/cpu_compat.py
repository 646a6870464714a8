"""The one place that lets megatron-core run without an accelerator (CPU ranks over gloo).

megatron-core 0.16.1 calls `torch.cuda` unconditionally in a few paths the trainer uses: the tensor-parallel
RNG tracker (seeded and forked on every attention forward), the RoPE frequency device, the DDP grad buffers and
the global memory buffer. Without a GPU these calls are redirected to the CPU. Nothing is patched when
`torch.cuda.is_available()`; the patch is applied once per process.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_MARK = "_scalarlm_cpu_compat"


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _patch_torch_cuda() -> None:
    """Redirect the `torch.cuda` calls megatron-core makes on its CPU-reachable paths."""
    cuda = torch.cuda
    cuda.current_device = _cpu_device
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None


def _patch_megatron_rng() -> None:
    """The TP RNG tracker forks the CPU generator instead of a CUDA one (dropout is off in SFT anyway)."""
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def router_gemm_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MoE router gating (`moe_utils.RouterGatingLinearFunction`) reads a module global
    `te_general_gemm` that is only bound when TransformerEngine imports: without TE (CPU, or a GPU without it) the
    router raises NameError. Binding it to None selects megatron's own `torch.mm` path in the router dtype (fp32),
    forward and backward. Nothing changes where TE is installed."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def latent_attention_without_transformer_engine() -> None:
    """megatron-core 0.16.1's multi-latent attention believes TransformerEngine is present whenever its extension
    module imports, which without TE (CPU, or a GPU without it) binds `TELinear` to a mock: the constructor's
    `isinstance(self.linear_proj, TELinear)` then raises TypeError. Its `HAVE_TE` is set False when `TELinear` is no
    class (its fp8 branch needs TE anyway). Nothing changes where TE is installed."""
    import megatron.core.transformer.multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def activate_if_no_accelerator() -> bool:
    """Apply the CPU shim when no accelerator is present; return True if it is (now) active."""
    if torch.cuda.is_available():
        return False
    if getattr(torch.cuda, _MARK, False):
        return True
    _patch_torch_cuda()
    _patch_megatron_rng()
    setattr(torch.cuda, _MARK, True)
    logger.info("no accelerator: megatron-core torch.cuda calls redirected to CPU")
    return True
