"""Where this process sits in the job, as the launcher's environment says (torch-free).

Open MPI (`OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`) first, then torchrun (`RANK/WORLD_SIZE/LOCAL_RANK`), else one
plain process. `MASTER_ADDR/MASTER_PORT` name the rendezvous when the launcher sets them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher told it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    under_mpi: bool = False
    local_world_size: int = 1  # ranks on this host (they share its cores)
    omp_threads: int | None = None  # OMP_NUM_THREADS when the user or launcher set it


def launch_env_from(environ: Mapping[str, str]) -> LaunchEnv:
    """Read the launcher's variables (Open MPI first, then torchrun's); one plain process otherwise."""
    addr = environ.get("MASTER_ADDR") or None
    port = int(environ["MASTER_PORT"]) if environ.get("MASTER_PORT") else None
    threads = int(environ["OMP_NUM_THREADS"]) if environ.get("OMP_NUM_THREADS", "").isdigit() else None
    if "OMPI_COMM_WORLD_RANK" in environ:
        return LaunchEnv(
            rank=int(environ["OMPI_COMM_WORLD_RANK"]),
            world_size=int(environ["OMPI_COMM_WORLD_SIZE"]),
            local_rank=int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            master_addr=addr,
            master_port=port,
            under_mpi=True,
            local_world_size=int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", environ["OMPI_COMM_WORLD_SIZE"])),
            omp_threads=threads,
        )
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            master_addr=addr,
            master_port=port,
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
            omp_threads=threads,
        )
    return LaunchEnv(master_addr=addr, master_port=port, omp_threads=threads)
