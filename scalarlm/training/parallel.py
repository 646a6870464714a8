"""Process-group setup: rank discovery (mpirun, torchrun, one plain process), torch.distributed, megatron TP/DP.

Ranks come from Open MPI (`OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`), from torchrun (`RANK/WORLD_SIZE/LOCAL_RANK`),
or default to a single rank. The rendezvous address is `MASTER_ADDR/MASTER_PORT` when set; under mpirun without
them, rank 0 picks its host name and a free port and broadcasts them over MPI. The backend is NCCL on GPUs (RCCL is
NCCL on ROCm) and gloo on CPU. DP = world size / TP; with expert parallelism EP ranks of the DP dimension split a
mixture-of-experts model's experts.
"""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scalarlm.config import host_cores
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.cpu_compat import activate_if_no_accelerator
from scalarlm.training.launch_env import LaunchEnv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parallel:
    """The initialised layout of this rank: device, TP and DP coordinates and groups."""

    rank: int
    world_size: int
    device: torch.device
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    # Expert parallelism (MoE): the ranks that split the experts; 1 / the rank alone without it.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    # A CPU rank's threads, and its threads during a session step that overlaps generation (`cpu_thread_counts`);
    # (0, 0) on a GPU.
    cpu_threads: tuple[int, int] = (0, 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def use_cpu_threads(self, overlapped: bool) -> int:
        """Run the next step on this CPU rank's threads for it (`overlapped`: generation runs beside it on this
        host's CPU engine); returns the count (0 on a GPU)."""
        threads = self.cpu_threads[overlapped]
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rendezvous(env: LaunchEnv) -> tuple[str, int]:
    """The TCP store address: from the environment, else agreed over MPI, else loopback for one rank."""
    if env.master_addr and env.master_port:
        return env.master_addr, env.master_port
    if env.world_size == 1:
        return "127.0.0.1", _free_port()
    if not env.under_mpi:
        raise InvalidRequest("MASTER_ADDR and MASTER_PORT must be set for a multi-rank job outside mpirun")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != env.world_size:
        raise RuntimeError(f"MPI world size {comm.Get_size()} != OMPI_COMM_WORLD_SIZE {env.world_size}")
    proposal = None
    if env.rank == 0:
        host = env.master_addr or socket.gethostname()
        proposal = (socket.gethostbyname(host), env.master_port or _free_port())
    addr, port = comm.bcast(proposal, root=0)
    return addr, int(port)


def cpu_thread_counts(env: LaunchEnv, threads: int | None = None, overlapped: int | None = None) -> tuple[int, int]:
    """(a CPU rank's threads, its threads during a session step that overlaps generation on this host's CPU engine):
    `OMP_NUM_THREADS` for both when set, else the control plane's `threads` / `overlapped`, else the rank's share of
    this host's cores (all of them for one rank) / the same as the first.

    torch defaults every process to all cores, so N ranks on one host would run N x cores threads and thrash.
    """
    alone = env.omp_threads or threads or max(1, host_cores() // max(1, env.local_world_size))
    return alone, env.omp_threads or overlapped or alone


def _pass_through(model: Any = None, **options: Any) -> Any:
    """`torch.compile`'s signature, compiling nothing: the function itself (or a decorator returning it)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron() -> None:
    """Import megatron-core with `torch.compile` a pass-through while it loads (once per process).

    `megatron.core.jit` binds `torch.compile` as the decorator of its fused element-wise kernels (bias + GeLU/GeGLU/
    SwiGLU, MoE activations) when the package loads, and that decoration imports dynamo and inductor: 2.2-2.7 s of
    every rank's start on this 2-core box (`import megatron.core` 3.8-5.2 s, 1.6-2.5 s without; the suite starts 175+
    ranks). The trainer turns those fusions off (model.py: `bias_activation_fusion=False`, ...), and a kernel that
    runs anyway runs eagerly: the same arithmetic, unfused. A megatron already imported is left as it is.
    """
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _pass_through  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


def init_parallel(env: LaunchEnv, tensor_parallel_size: int, seed: int, timeout_s: float = 1800,
                  gpu_memory_fraction: float | None = None, expert_parallel_size: int = 1,
                  cpu_threads: int | None = None, cpu_threads_overlapped: int | None = None) -> Parallel:
    """Start torch.distributed and megatron's model-parallel state for this rank.

    `expert_parallel_size`: ranks that split a mixture-of-experts model's experts (megatron's EP groups lie across
    the data-parallel ranks; the experts keep the dense layers' TP size).

    `gpu_memory_fraction`: the share of its GPU this rank may allocate (an embedded node, where vLLM holds the
    rest); None: the whole GPU. `cpu_threads` / `cpu_threads_overlapped`: a CPU rank's threads, and its threads
    during a session step that overlaps generation (see `cpu_thread_counts`).
    """
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    if env.world_size % (tensor_parallel_size * expert_parallel_size):
        raise InvalidRequest(f"tensor_parallel_size {tensor_parallel_size} x expert_parallel_size "
                             f"{expert_parallel_size} must divide the world size {env.world_size}")  # fmt: skip
    on_gpu = torch.cuda.is_available()
    threads = (0, 0)
    if on_gpu:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        if gpu_memory_fraction:
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, device)
            logger.info("rank %d: at most %.0f%% of %s (vLLM holds the rest)", env.rank, 100 * gpu_memory_fraction,
                        device)
    else:
        activate_if_no_accelerator()
        device = torch.device("cpu")
        threads = cpu_thread_counts(env, cpu_threads, cpu_threads_overlapped)
        torch.set_num_threads(threads[0])
        logger.info("rank %d: %d CPU threads (%d while a session step overlaps generation)", env.rank, *threads)
    addr, port = _rendezvous(env)
    backend = "nccl" if on_gpu else "gloo"
    logger.info("rank %d/%d: %s rendezvous at %s:%d", env.rank, env.world_size, backend, addr, port)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        expert_model_parallel_size=expert_parallel_size,
        create_gloo_process_groups=on_gpu,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # on a GPU also the default CUDA generator's seed
    torch.manual_seed(seed)  # the CPU generator's (LoRA dropout draws from it there): the same on every rank
    return Parallel(
        rank=env.rank,
        world_size=env.world_size,
        device=device,
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group() if expert_parallel_size > 1 else None,
        cpu_threads=threads,
    )


def shutdown_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
