"""One validated settings object: defaults, then a YAML file, then `SCALARLM_*` environment variables.

Loaded once by the entry point (`load_settings()`) and passed down; nothing else reads the environment.
Nested sections use `__` in env names: `SCALARLM_ENGINE__MAX_MODEL_LEN=1024`. A few common top-level
keys also have short env names (`SCALARLM_MODEL`, `SCALARLM_HOME`, `SCALARLM_PORT`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ServerSettings(BaseModel):
    """Where the control plane listens and how it behaves toward clients."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    role: Literal["embedded", "api", "worker"] = "embedded"
    # In split mode: where a worker finds the control plane, and where the control plane finds workers.
    api_url: str = "http://127.0.0.1:8000"
    worker_urls: list[str] = Field(default_factory=list)
    worker_port: int = Field(8001, ge=0, le=65535)
    api_keys: list[str] = Field(default_factory=list)
    # One key a line: `<key> [scope1,scope2] [max_queued=N] [max_jobs=M]` (see server/auth.py).
    api_keys_file: Path | None = None
    # Split mode: the key between the control plane and its workers (a mounted Secret file); None: the one on the
    # shared volume, `$SCALARLM_HOME/internal/worker.key`, created by whichever starts first.
    worker_key_file: Path | None = None
    allow_insecure_public: bool = False
    # SIGTERM: answer new requests 503 while in-flight ones finish, for at most this long, then exit.
    shutdown_seconds: float = Field(30.0, gt=0)
    # Admission control for interactive OpenAI requests: in flight beyond factor x max_num_seqs -> 429.
    admit_factor: float = Field(4.0, gt=0)


# How each accelerator's memory is divided (fractions of one GPU). vLLM's share covers its weights, activations
# and KV cache (`gpu_memory_utilization`). Dedicated: vLLM has the GPUs to itself (a worker pod, split mode).
# Shared: an embedded node whose local launcher runs the trainer's ranks on the same GPUs; what neither share
# takes is headroom for the CUDA/NCCL contexts outside both allocators. docs/deploy.md ("Sizing") and the
# chart's `worker.gpuMemoryUtilization` state the same numbers (tests/unit/deploy/test_gpu_memory_split.py).
DEDICATED_VLLM_SHARE = 0.85
SHARED_VLLM_SHARE = 0.40
SHARED_TRAINER_SHARE = 0.55
SHARED_HEADROOM = 0.05
# vLLM's CPU backend cannot size its KV cache from a memory fraction (it applies it to host RAM): it gets bytes.
CPU_KV_CACHE_BYTES = 1 << 30
# `engine.max_model_len` on CPU when unset (the KV cache above holds 256 sequences of it in float32 for small models).
CPU_MAX_MODEL_LEN = 512


class EngineSettings(BaseModel):
    """vLLM engine settings; CPU-safe defaults measured on a 2-core box (see ARCHITECTURE.md)."""

    # Context length (prompt + output). None: CPU_MAX_MODEL_LEN on CPU; on an accelerator the model's own context if
    # its KV cache fits in the engine's memory share, else the longest that does (vLLM's `--max-model-len -1`).
    max_model_len: int | None = Field(None, ge=16)
    # None: float32 on CPU (served outputs equal transformers' fp32 ones), "auto" on an accelerator (the checkpoint's
    # own dtype: the trainer's bf16 there) -- resolved where the engine starts (`inference.engine.engine_dtype`).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # KV cache size in bytes. None: on an accelerator the KV cache is whatever `gpu_memory_utilization` leaves
    # after the weights and activations (vLLM's own sizing); on CPU, CPU_KV_CACHE_BYTES. Set it only to pin
    # the size: vLLM then ignores `gpu_memory_utilization` for the KV cache.
    kv_cache_bytes: int | None = Field(None, ge=1 << 20)
    max_num_seqs: int = Field(256, ge=1)
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    # Fraction of each GPU vLLM takes. None: DEDICATED_VLLM_SHARE, or SHARED_VLLM_SHARE when the trainer
    # shares the GPUs (see `gpu_memory_split`).
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_lora: bool = True
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    seed: int = 0
    # OpenAI tool calling on /v1/chat/completions: vLLM's parser of the model's tool-call format ("hermes" for Qwen,
    # "llama3_json" for Llama 3.1+, ...; vLLM's --tool-call-parser, with --enable-auto-tool-choice). None: a request
    # with tools and tool_choice "auto" is refused (vLLM's 400).
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser ("qwen3", "deepseek_r1", ...): a thinking model's reasoning is returned apart from its
    # answer (`reasoning_content`). None: it stays in the text.
    reasoning_parser: str | None = None


class GenerateSettings(BaseModel):
    """Batch queue behaviour."""

    response_timeout: float = Field(60.0, ge=0)
    # Longest a request may long-poll (`wait_seconds`), so no client holds a connection open forever.
    max_wait_seconds: float = Field(600.0, gt=0)
    default_max_tokens: int = Field(16, ge=1)
    lease_seconds: float = Field(300.0, gt=0)
    max_batch_prompts: int = Field(1_000_000, ge=1)
    max_lease_batch: int = Field(1024, ge=1)
    poll_interval: float = Field(0.02, gt=0)
    # Finished results stay readable this long, then housekeeping deletes them (the queue file stays bounded).
    result_retention_seconds: float = Field(7 * 86400.0, gt=0)
    housekeeping_interval: float = Field(300.0, gt=0)


class UploadSettings(BaseModel):
    """Limits on request bodies and uploaded files."""

    max_request_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    max_upload_bytes: int = Field(10 * 1024**3, ge=1024)
    max_chunk_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # A chunked upload no chunk reached for this long is removed with its chunks (its client gave up; init with the
    # same archive then starts it over). Until then, init with the same archive resumes it.
    abandoned_upload_seconds: float = Field(86400.0, gt=0)


class TrainingSettings(BaseModel):
    """Defaults for training jobs launched by this control plane."""

    launcher: Literal["local", "slurm"] = "local"
    max_train_seconds: int = Field(86400, ge=1)
    cpu_ranks: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    nodes: int = Field(1, ge=1)
    poll_seconds: float = Field(1.0, gt=0)
    # Local launcher: at most this many trainers run at once on this machine (0: no limit); on a GPU node
    # (`gpus_per_node` > 0) a GPU job also waits until the GPUs it asks for are free. Waiting jobs stay QUEUED and
    # start in submission order as others finish (also after a restart). SLURM queues its jobs itself.
    max_running_jobs: int = Field(0, ge=0)
    # An RL session whose client sends no step request for this long ends itself: state saved, status CANCELLED
    # (resume it to continue). 0: never (the trainer waits for `end` or a cancel).
    session_idle_seconds: float = Field(1800.0, ge=0)
    # SIGTERM to the control plane: "checkpoint" asks each trainer it launched on this machine (local launcher:
    # it would die with the container) to save its state and stop as QUEUED; "detach" leaves them running, to be
    # re-adopted on restart. SLURM jobs always keep running.
    on_shutdown: Literal["checkpoint", "detach"] = "checkpoint"
    # How long a stopped (cancelled, shut down) trainer may take to save its state before SIGKILL.
    stop_grace_seconds: float = Field(30.0, gt=0)
    # On start (and every poll): "interrupted" relaunches the jobs a shutdown stopped, from their saved state;
    # "all" also relaunches jobs whose trainer died without a final status (a crash), at most `max_resumes`
    # times each; "none" reports both FAILED (POST /v1/megatron/resume/<job_id> continues one by hand).
    resume: Literal["none", "interrupted", "all"] = "interrupted"
    max_resumes: int = Field(3, ge=0)
    # Full-weight publish on an embedded node with the local launcher (trainer and engine on one host): the trainer
    # stages each step in this memory-backed directory, the engine serves it from there, and the durable copy in
    # the job directory lands in the background while training goes on (checkpoint/staging.py). "": always wait
    # for the durable write. Skipped where the directory does not exist.
    staging_dir: str = "/dev/shm"
    # Threads of each CPU trainer rank. 0: the host's cores shared among the job's ranks, except for an RL session
    # that overlaps generation (`max_staleness` >= 1) on an embedded node without GPUs, whose vLLM engine computes on
    # the same cores: there the trainer takes half of them (`trainer_cpu_threads`).
    cpu_threads: int = Field(0, ge=0)
    # SLURM launcher: more sbatch options for every job, each written as an `#SBATCH` line of its script, e.g.
    # ["--partition=gpu", "--account=ml", "--qos=high", "--cpus-per-task=12", "--mem=0", "--constraint=h100"]. The
    # options the job's own size and lifecycle set (nodes, tasks, GPUs, time, signal, output, ...) are refused.
    sbatch_options: list[str] = Field(default_factory=list)

    @field_validator("sbatch_options")
    @classmethod
    def _sbatch_options(cls, options: list[str]) -> list[str]:
        for option in options:
            name = option.split("=", 1)[0].split()[0] if option.strip() else ""
            if not name.startswith("-") or "\n" in option or "\r" in option:
                raise ValueError(f"sbatch option {option!r} must be one option on one line, e.g. '--partition=gpu'")
            name = name if name.startswith("--") else name[:2]  # -N2, -N 2
            # sbatch takes any unambiguous start of a long name: --sig=... is --signal
            if name in SBATCH_REFUSED or (len(name) > 3 and any(r.startswith(name) for r in SBATCH_REFUSED)):
                raise ValueError(f"sbatch option {option!r}: {name} is set from each job (its gpus, nodes, cpu_ranks "
                                 "and timeout) or would keep the launcher from tracking it; leave it out")
        return options


# sbatch options `sbatch_options` may not give: those the SLURM launcher derives from each job
# (launcher/sbatch_script.py: its size, rank placement, time limit, signal, log), and those that would keep the launcher
# from tracking the job (--wait blocks sbatch, --test-only submits nothing, --hold never starts it, --clusters hides it
# from squeue, --wrap replaces the script).
SBATCH_REFUSED = frozenset({
    "--nodes", "--ntasks", "--ntasks-per-node", "--ntasks-per-gpu", "--ntasks-per-socket", "--ntasks-per-core",
    "--distribution", "--gres", "--gpus", "--gpus-per-node", "--gpus-per-task", "--tres-per-task", "--time", "--signal",
    "--output", "--error", "--open-mode", "--chdir", "--export", "--job-name", "--requeue", "--no-requeue", "--array",
    "--wait", "--test-only", "--hold", "--clusters", "--wrap", "--parsable",
    "-N", "-n", "-m", "-G", "-t", "-o", "-e", "-D", "-J", "-a", "-W", "-H", "-M",
})  # fmt: skip


def default_hf_cache() -> Path:
    """Where Hugging Face keeps downloaded models: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


class Settings(BaseSettings):
    """Every knob of scalarlm. Build once with `load_settings()`."""

    model_config = SettingsConfigDict(env_prefix="SCALARLM_", env_nested_delimiter="__", extra="forbid")

    model: str = "./models/tiny"
    home: Path = Path("./.scalarlm")
    served_model_name: str | None = None
    # The local Hugging Face cache: `model` and a job's `llm_name` may be hub ids found there (never downloaded).
    hf_cache: Path = Field(default_factory=default_hf_cache)
    # The level of the server's log (root logger and uvicorn, any case); a trainer's own log stays at INFO.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    generate: GenerateSettings = Field(default_factory=GenerateSettings)
    upload: UploadSettings = Field(default_factory=UploadSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v

    @property
    def base_model_name(self) -> str:
        """The name clients use for the base model."""
        return self.served_model_name or Path(self.model).name or self.model

    @property
    def queue_path(self) -> Path:
        return self.home / "queue.sqlite"

    @property
    def jobs_dir(self) -> Path:
        return self.home / "jobs"


class GpuMemorySplit(NamedTuple):
    """Fractions of each GPU: vLLM's (`gpu_memory_utilization`) and the trainer's ranks' (0: not on these GPUs)."""

    vllm: float
    trainer: float


def trainer_shares_gpus(settings: Settings) -> bool:
    """Whether the trainer's ranks run on this node's GPUs beside vLLM: an embedded node with the local launcher."""
    return settings.server.role == "embedded" and settings.training.launcher == "local"


def gpu_memory_split(settings: Settings) -> GpuMemorySplit:
    """How this node divides each GPU between vLLM and the trainer (an explicit `gpu_memory_utilization` wins)."""
    shared = trainer_shares_gpus(settings)
    vllm = settings.engine.gpu_memory_utilization
    if vllm is None:
        vllm = SHARED_VLLM_SHARE if shared else DEDICATED_VLLM_SHARE
    if not shared:
        return GpuMemorySplit(vllm=vllm, trainer=0.0)
    trainer = SHARED_TRAINER_SHARE if settings.engine.gpu_memory_utilization is None else 1.0 - SHARED_HEADROOM - vllm
    return GpuMemorySplit(vllm=vllm, trainer=round(max(trainer, 0.0), 4))


def host_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def trainer_cpu_threads(settings: Settings, *, ranks: int, cores: int, cpu_job: bool, overlaps: bool,
                        beside_engine: bool) -> int | None:  # fmt: skip
    """Threads for each CPU rank of a job (None: the trainer's own share, `cores` ÷ `ranks`).

    `training.cpu_threads` when set. Else, for a CPU job while it overlaps generation (`overlaps`: a session step
    the client generates beside, see SessionStepRequest.overlap) on the engine's host (`beside_engine`: an embedded
    node's local launcher) without GPUs, half of its `cores`: vLLM's CPU engine
    (one worker, TP=1) runs torch's default of one thread per core, and a trainer doing the same while it generates
    puts two busy OpenMP threads on every core, where each parallel region of either side waits for a descheduled
    thread. Measured on 2 cores (bench/grpo_learn.py's loop): an async step took 2.5 s with 2 trainer threads, 1.3-1.5
    s with 1. A step nothing generates beside keeps every core: on a 2-core AVX2 box bench/grpo.py's synchronous
    step took 6.9 s with 1 thread and 4.8 s with 2.
    """
    training = settings.training
    if not cpu_job:
        return None
    if training.cpu_threads:
        return training.cpu_threads
    if not (overlaps and beside_engine and training.gpus_per_node == 0):
        return None
    return max(1, cores // 2 // max(1, ranks))


# Short env names for the settings people set most, mapped to their nested place.
_SHORTCUTS = {
    "SCALARLM_HOST": ("server", "host"),
    "SCALARLM_PORT": ("server", "port"),
    "SCALARLM_API_KEYS": ("server", "api_keys"),
    "SCALARLM_API_KEYS_FILE": ("server", "api_keys_file"),
    "SCALARLM_WORKER_KEY_FILE": ("server", "worker_key_file"),
    "SCALARLM_MAX_MODEL_LEN": ("engine", "max_model_len"),
    "SCALARLM_DTYPE": ("engine", "dtype"),
    "SCALARLM_MAX_NUM_SEQS": ("engine", "max_num_seqs"),
    "SCALARLM_KV_CACHE_BYTES": ("engine", "kv_cache_bytes"),
    "SCALARLM_RESPONSE_TIMEOUT": ("generate", "response_timeout"),
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _shortcut_values(environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, (section, key) in _SHORTCUTS.items():
        if name in environ:
            raw: Any = environ[name]
            if key == "api_keys":
                raw = [k.strip() for k in raw.split(",") if k.strip()]
            values.setdefault(section, {})[key] = raw
    return values


class _ShortcutSource(PydanticBaseSettingsSource):
    """Reads the short env names (`SCALARLM_PORT`, `SCALARLM_API_KEYS`, ...)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _shortcut_values(dict(os.environ))


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML settings file, if one is named."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if not self.path:
            return {}
        loaded = yaml.safe_load(Path(self.path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {self.path} must hold a mapping at the top level")
        return loaded


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings once: defaults < YAML (`config_file` or `SCALARLM_CONFIG`) < env < overrides.

    `overrides` uses the nested shape (`server={"port": 9000}`); CLI flags pass them.
    """
    path = config_file or os.environ.get("SCALARLM_CONFIG")

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _ShortcutSource(settings_cls), _YamlSource(settings_cls, path))

    loaded = _Loaded(**overrides)
    return Settings.model_validate(loaded.model_dump())
