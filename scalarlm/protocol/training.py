"""Wire models of training jobs: the typed train args, job status, checkpoint manifest and model listing."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Job ids and model names: safe as one path component under $SCALARLM_HOME/jobs.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

JobState = Literal["QUEUED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"]
# What a session does with a batch generated more than `max_staleness` versions before the weights it would
# train: "refuse" it (409 naming the versions), or "reweight" it: train it with its clipped importance ratio
# exp(logp - logp_sampling) against the sampling logprobs, which every scored row must then carry.
StalePolicy = Literal["refuse", "reweight"]
TERMINAL_STATES: frozenset[str] = frozenset({"COMPLETED", "FAILED", "CANCELLED"})


MAX_STEPS = 10_000_000  # the most `max_steps` a job may ask for (an RL session that names none is open-ended)


def check_name(value: str, what: str = "name") -> str:
    """Return `value` if it is a safe job id / model name, else raise ValueError saying why."""
    if not NAME_PATTERN.match(value) or ".." in value:
        raise ValueError(f"{what} {value!r} must match {NAME_PATTERN.pattern} (letters, digits, '.', '_', '-')")
    return value


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # PEFT's names of a block
# `target_modules`' default, PEFT's shorthand: every projection the family's adapters can be trained and served on.
# Named modules are taken as named (one an adapter cannot have on the family is a 400), so the two stay apart.
DEFAULT_TARGETS = "all-linear"


def _one_name(values: Any, names: dict[str, str]) -> Any:
    """Accept ScalarLM's (and PEFT's) name for a key as ours (`names`: theirs -> ours); both sent is an error unless
    they agree."""
    if not isinstance(values, dict):
        return values
    values = dict(values)
    for theirs, ours in names.items():
        if theirs in values:
            value = values.pop(theirs)
            if ours in values and values[ours] != value:
                raise ValueError(f"{theirs!r} and {ours!r} name the same setting; send one of them")
            values[ours] = value
    return values


class LoraConfig(BaseModel):
    """LoRA's rank, scale and targets; ScalarLM's and PEFT's names `lora_alpha`, `lora_dropout` and
    `target_modules: "all-linear"` are accepted too."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: [DEFAULT_TARGETS])

    @model_validator(mode="before")
    @classmethod
    def _their_names(cls, values: Any) -> Any:
        values = _one_name(values, {"lora_alpha": "alpha", "lora_dropout": "dropout"})
        if isinstance(values, dict) and values.get("target_modules") == DEFAULT_TARGETS:
            values["target_modules"] = [DEFAULT_TARGETS]  # (PEFT writes the shorthand as a string)
        return values


class TrainArgs(BaseModel):
    """Train args: ScalarLM's keys plus ours. Unknown keys are rejected (400), never silently dropped."""

    model_config = ConfigDict(extra="forbid")

    # ScalarLM JobConfig keys.
    llm_name: str | None = None
    max_steps: int = Field(100, ge=1, le=MAX_STEPS)
    learning_rate: float = Field(3e-4, gt=0, le=10)
    batch_size: int = Field(1, ge=1, le=65_536)
    gradient_accumulation_steps: int = Field(1, ge=1, le=65_536)
    gradient_checkpointing: bool = False
    warmup_steps: int = Field(0, ge=0)
    # ScalarLM's name for the block length: when sent, it is `max_seq_len` (sending both with different values is
    # a 400).
    max_token_block_size: int | None = Field(None, ge=8, le=1_048_576)
    training_mode: Literal["language_model"] = "language_model"
    distribution_strategy: Literal["ddp", "fsdp", "megatron"] = "megatron"
    steps_per_checkpoint: int = Field(100, ge=1)
    # Published steps kept on disk: after each one lands, the steps older than the newest this many are removed
    # (ScalarLM's key; its default is 3). None keeps every step (a job's default; an RL session keeps 3).
    max_checkpoints_to_keep: int | None = Field(None, ge=1)
    gpus: int = Field(0, ge=0, le=4096)
    nodes: int = Field(1, ge=1, le=1024)
    adapter_type: Literal["lora", "full", "none", "tokenformer"] = "lora"
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    timeout: int = Field(4 * 3600, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    trust_remote_code: bool = False
    # Ours.
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # Mixture-of-experts models: the experts are split over this many ranks (megatron's
    # expert_model_parallel_size); the ranks of one expert group also split the batch (data parallel).
    expert_parallel_size: int = Field(1, ge=1, le=64)
    # Mixture-of-experts models: weight of the load-balancing (aux) loss, megatron's per-layer switch loss summed over
    # the MoE layers (0: off; its value is in the metrics either way).
    moe_aux_loss_coef: float = Field(0.0, ge=0, le=100)
    cpu_ranks: int = Field(1, ge=1, le=256, description="ranks when gpus == 0 (CPU/gloo)")
    launcher: Literal["local", "slurm"] | None = None
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # TRL's disable_dropout: train without the dropout the checkpoint's config sets (on the attention probabilities,
    # the residual branches, StarCoder2's embeddings; Seed-OSS's and StarCoder2's checkpoints set 0.1), otherwise
    # applied in training as transformers does.
    disable_dropout: bool = False
    max_seq_len: int = Field(512, ge=8, le=1_048_576)
    pack: bool = True
    shuffle: bool = True
    # Publish a servable checkpoint every this many steps (None: every `steps_per_checkpoint`); resume state is
    # saved every `steps_per_checkpoint` steps, so a job can serve new weights often and save optimizer state rarely.
    # On the serving host a published step is served from memory at once; one that is not a `steps_per_checkpoint`
    # step (nor the last) keeps no durable copy if a newer step is published before its copy begins to land.
    steps_per_publish: int | None = Field(None, ge=1)
    # "dapo": GRPO's advantages and clipped objective with every completion token of the step weighted alike (TRL's
    # default loss_type); "dr_grpo": unscaled advantages and a constant normaliser (`max_completion_length`);
    # "cispo" (MiniMax-M1's, TRL's): the importance weight, capped at `clip_eps_high` and detached, times the
    # advantage and the token's logprob, weighted as dapo; "sapo" (TRL's): a smooth gate on the ratio,
    # sigmoid(t (ratio - 1)) 4 / t, in place of the clip (t: `sapo_temperature_pos` / `_neg`), weighted as grpo.
    loss: Literal["sft", "grpo", "dr_grpo", "dapo", "cispo", "sapo"] = "sft"
    # dr_grpo's constant: the longest completion the sampler may write (TRL's max_completion_length). None: the
    # longest completion of each step's batch.
    max_completion_length: int | None = Field(None, ge=1)
    # How advantages are scaled (TRL's scale_rewards): "group" divides each reward's distance from its group's mean by
    # the group's std, "batch" by the std of every reward of the step, "none" not at all. None: the loss's own
    # ("none" for dr_grpo, else "group").
    scale_rewards: Literal["group", "batch", "none"] | None = None
    kl_coef: float = Field(0.0, ge=0)
    # GRPO jobs: optimizer steps over each batch of groups (TRL's num_iterations, the paper's mu). The later steps'
    # ratio compares with the first step's logprobs where a row has no sampling logprobs.
    num_iterations: int = Field(1, ge=1, le=64)
    # Mixture-of-experts GRPO with num_iterations > 1: the later steps reuse the experts the first step chose.
    routing_replay: bool = False
    clip_eps: float = Field(0.2, gt=0)
    # The ratio's upper clip, 1 + clip_eps_high (DAPO's clip-higher, TRL's epsilon_high). None: 1 + clip_eps.
    clip_eps_high: float | None = Field(None, gt=0)
    # TRL's mask_truncated_completions (DAPO's overlong filtering): a completion that stopped at max_tokens (row
    # `finish_reason` "length", required on every row) adds nothing to the loss, nor to dapo's token count; its reward
    # still counts in its group's advantages.
    mask_truncated_completions: bool = False
    # TRL's importance_sampling_level: "token" (a ratio per token) or "sequence" (GSPO: one ratio per completion, the
    # exp of the mean of its tokens' log ratios; GSPO's paper clips it at clip_eps 3e-4, clip_eps_high 4e-4).
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # TRL's delta (INTELLECT-2's two-sided clipping): the unclipped ratio is capped at delta too, so a token with a
    # negative advantage cannot push the loss without bound (recommended above 1 + clip_eps_high; clipping losses only).
    delta: float | None = Field(None, gt=1)
    # TRL's off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence masking): a completion with a negative
    # advantage whose mean (sampling - policy) logprob over its tokens exceeds it adds nothing to the policy term.
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    # TRL's use_bias_correction_kl (there on by default, here off): the KL term is multiplied by the (differentiable)
    # ratio, DeepSeek-V3.2's unbiased reverse-KL gradient. Needs kl_coef > 0.
    use_bias_correction_kl: bool = False
    # sapo's gate temperatures (TRL's): for tokens with a positive advantage, and for the others.
    sapo_temperature_pos: float = Field(1.0, gt=0)
    sapo_temperature_neg: float = Field(1.05, gt=0)
    # TRL's vllm_importance_sampling_correction: the ratio compares with the trainer's own logprobs of the batch (its
    # first step's) and each token's objective is weighted by exp(trainer - sampler logprob), per token or summed over
    # its completion (mode "token_*" / "sequence_*"), clipped to [clip_min, clip_max] ("*_truncate") or 0 outside it
    # ("*_mask"). Off (the default): the ratio compares with the rows' sampling logprobs, clipped as the loss clips.
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "sequence_mask"
    )
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0)
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0)
    # Published checkpoints: "source" keeps each tensor's dtype of the base checkpoint (a LoRA adapter: float32).
    publish_dtype: Literal["source", "float32", "bfloat16", "float16"] = "source"

    @model_validator(mode="before")
    @classmethod
    def _their_names(cls, values: Any) -> Any:
        return _one_name(values, {"gradient_clip_value": "max_grad_norm"})  # ScalarLM's name for the clipping norm

    @field_validator("llm_name")
    @classmethod
    def _no_path_tricks(cls, v: str | None) -> str | None:
        if v is not None and ("\x00" in v or v.startswith("-")):
            raise ValueError("llm_name must be a model directory or name")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "TrainArgs":
        if self.adapter_type == "none":
            self.adapter_type = "full"  # ScalarLM's name for "train every weight"
        if self.adapter_type == "tokenformer":
            raise ValueError("adapter_type 'tokenformer' is not supported; use 'lora' or 'full'")
        _refuse_unsupported(self)
        self._block_length()
        ranks = self.world_size
        if ranks % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} must divide the number of ranks {ranks}"
            )
        if ranks % (self.tensor_parallel_size * self.expert_parallel_size):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} x expert_parallel_size "
                             f"{self.expert_parallel_size} must divide the number of ranks {ranks}")  # fmt: skip
        return self

    def _block_length(self) -> None:
        """`max_token_block_size` (ScalarLM) and `max_seq_len` (ours) name one length: keep them equal."""
        if self.max_token_block_size is None:
            return
        if "max_seq_len" in self.model_fields_set and self.max_seq_len != self.max_token_block_size:
            raise ValueError(f"max_token_block_size {self.max_token_block_size} and max_seq_len {self.max_seq_len} "
                             "name the same block length; send one of them")
        self.max_seq_len = self.max_token_block_size

    @property
    def world_size(self) -> int:
        """Ranks the job runs: one per GPU, or `cpu_ranks` on CPU."""
        return self.gpus * self.nodes if self.gpus else self.cpu_ranks

    @property
    def publish_every(self) -> int:
        """Steps between published checkpoints."""
        return self.steps_per_publish or self.steps_per_checkpoint

    @property
    def reward_scaling(self) -> Literal["group", "batch", "none"]:
        """How this job scales its advantages: `scale_rewards`, else its loss's own."""
        return self.scale_rewards or ("none" if self.loss == "dr_grpo" else "group")

    @property
    def trains_balance_loss(self) -> bool:
        """A MoE load-balancing loss is trained: its value depends on every token a forward pass holds (so rows that
        share a prompt cannot compute it once, and a datum is its own forward pass when a gradient is taken)."""
        return self.moe_aux_loss_coef > 0


def _refuse_unsupported(args: TrainArgs) -> None:
    """Settings the trainer would otherwise accept and not honour: refused, naming the field and what to send."""
    if args.trust_remote_code:
        raise ValueError("trust_remote_code: true is not supported: the trainer maps only the model families it "
                         "knows to megatron-core and never runs a checkpoint's own code; leave it false")
    if args.distribution_strategy == "fsdp":
        raise ValueError("distribution_strategy 'fsdp' is not supported: the trainer runs megatron-core data and "
                         "tensor parallelism ('megatron', the default, or 'ddp' for data parallel only)")
    if args.distribution_strategy == "ddp" and args.tensor_parallel_size > 1:
        raise ValueError("distribution_strategy 'ddp' is data parallel only; use 'megatron' with "
                         f"tensor_parallel_size {args.tensor_parallel_size}")
    if args.loss == "sft" and args.clip_eps_high is not None:
        raise ValueError("clip_eps_high is a GRPO setting (the importance ratio's upper clip); an SFT loss has no "
                         "ratio to clip")
    if args.loss == "sft" and args.kl_coef > 0:
        raise ValueError("kl_coef is a GRPO setting (an RL loss such as 'grpo'): an SFT loss has no "
                         "reference to stay near; leave it at 0")
    if args.loss == "sft" and args.mask_truncated_completions:
        raise ValueError("mask_truncated_completions is a GRPO setting (it leaves out completions that hit "
                         "max_tokens); an SFT loss trains every row")
    if args.loss == "sft" and args.importance_sampling_level != "token":
        raise ValueError("importance_sampling_level is a GRPO setting (how the importance ratio is taken); an SFT loss "
                         "has no ratio")
    if args.loss == "sft" and args.scale_rewards is not None:
        raise ValueError("scale_rewards is a GRPO setting (how advantages are scaled); an SFT loss has no rewards")
    if args.max_completion_length is not None and args.loss != "dr_grpo":
        raise ValueError("max_completion_length is dr_grpo's normaliser; the other losses do not read it")
    if args.loss != "sft" and not args.pack:
        raise ValueError("pack: false is an SFT setting: GRPO batches are always packed (each row kept whole, "
                         "attention within it, so packing changes no row's loss); leave it at true")
    _refuse_unread_policy_settings(args)
    if args.loss == "sft" and (args.num_iterations > 1 or args.routing_replay):
        raise ValueError("num_iterations and routing_replay are GRPO settings (an RL loss such as 'grpo'); "
                         "SFT takes one optimizer step per batch")
    if args.routing_replay and args.num_iterations == 1:
        raise ValueError("routing_replay reuses a batch's first-step expert choices in its later steps: set "
                         "num_iterations > 1 (the sampler's own choices are not available: vLLM returns them only "
                         "from its GPU model runner)")
    if args.distribution_strategy == "ddp" and args.expert_parallel_size > 1:
        raise ValueError("distribution_strategy 'ddp' is data parallel only; use 'megatron' with "
                         f"expert_parallel_size {args.expert_parallel_size}")
    if args.dtype == "float16":
        raise ValueError("dtype 'float16' is not supported for training (no loss scaling); use 'bfloat16' "
                         "(GPUs), 'float32' or 'auto'")
    if args.dtype == "bfloat16" and args.gpus == 0:
        raise ValueError("dtype 'bfloat16' needs GPUs: CPU ranks (gpus 0) train in float32; send dtype 'auto' "
                         "or 'float32', or gpus > 0")


def _refuse_unread_policy_settings(args: TrainArgs) -> None:
    """The settings of one GRPO objective given with a loss that does not read them, or inconsistent. "Given" is "not
    at its default", so a stored config (every field written out) reads back as it was accepted."""
    if args.loss == "cispo" and args.clip_eps_high is None:
        raise ValueError("loss 'cispo' caps its importance weight at clip_eps_high (the weight itself, as TRL's "
                         "epsilon_high for cispo, not 1 + it): send it (ScaleRL's paper uses 5.0)")
    if args.loss in ("cispo", "sapo") and _given(args, "clip_eps"):
        raise ValueError(f"loss {args.loss!r} does not clip the ratio from below: clip_eps is not read; leave it out")
    if args.loss == "sapo" and args.clip_eps_high is not None:
        raise ValueError("loss 'sapo' gates the ratio smoothly (sapo_temperature_pos / _neg) instead of clipping it: "
                         "clip_eps_high is not read; leave it out")
    if args.delta is not None and args.loss in ("sft", "cispo", "sapo"):
        raise ValueError(f"delta caps the clipped ratio of loss 'grpo', 'dr_grpo' or 'dapo'; loss {args.loss!r} "
                         "does not read it: leave it out")
    if args.off_policy_mask_threshold is not None and args.loss == "sft":
        raise ValueError("off_policy_mask_threshold is a GRPO setting (it masks sampled completions that drifted "
                         "off-policy); an SFT loss has no sampled completions")
    if args.use_bias_correction_kl and args.kl_coef == 0:
        raise ValueError("use_bias_correction_kl weighs the KL term by the ratio, and kl_coef is 0 (no KL term): set "
                         "kl_coef > 0, or leave it out")
    if args.loss != "sapo" and _given(args, "sapo_temperature_pos", "sapo_temperature_neg"):
        raise ValueError("sapo_temperature_pos / _neg are read by loss 'sapo' only; leave them out")
    if not args.vllm_importance_sampling_correction:
        if _given(args, *(f"vllm_importance_sampling_{k}" for k in ("mode", "clip_max", "clip_min"))):
            raise ValueError("vllm_importance_sampling_mode / _clip_max / _clip_min shape the correction that "
                             "vllm_importance_sampling_correction: true turns on; send it too, or leave them out")
        return
    if args.loss == "sft":
        raise ValueError("vllm_importance_sampling_correction is a GRPO setting (it weighs sampled completions by "
                         "trainer / sampler probability); an SFT loss has no sampled completions")
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                         f"vllm_importance_sampling_clip_max ({high})")
    if low is None and high is None and args.vllm_importance_sampling_mode.endswith("_truncate"):
        raise ValueError("a '*_truncate' vllm_importance_sampling_mode clips the weight to [clip_min, clip_max]: "
                         "send vllm_importance_sampling_clip_max or _clip_min (or both)")


def _given(args: TrainArgs, *names: str) -> bool:
    """Any of these fields differs from its default."""
    return any(getattr(args, n) != TrainArgs.model_fields[n].default for n in names)


class TrainJobConfig(BaseModel):
    """What `jobs/<id>/job.yaml` holds: the validated request as submitted."""

    job_id: str
    base_model: str
    train_args: TrainArgs
    dataset_rows: int = 0
    created: float = 0.0
    session: bool = False
    # A session's staleness bound and what it does with a batch beyond it (see SessionCreateRequest).
    session_max_staleness: int = 1
    session_stale_policy: StalePolicy = "refuse"
    # A session's trainer ends itself (state saved, CANCELLED) after this long without a step request; None: never.
    session_idle_seconds: float | None = None
    # The run's time limit, min(train_args.timeout, training.max_train_seconds), set by the control plane: past it
    # the trainer saves its state at the next step boundary and ends FAILED saying so. None: train_args.timeout.
    max_train_seconds: float | None = None
    # The share of each GPU the trainer's ranks may allocate, set by the control plane when they share the GPUs with
    # its vLLM engine (an embedded node with the local launcher; config.gpu_memory_split). None: the whole GPU.
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    # Threads of each CPU rank, set by the control plane (config.trainer_cpu_threads). None: the host's cores ÷ the
    # ranks. `cpu_threads_overlapped`: a session step's threads while generation overlaps it on this host's CPU
    # vLLM engine (the request's `overlap`); None: `cpu_threads`.
    cpu_threads: int | None = Field(None, ge=1)
    cpu_threads_overlapped: int | None = Field(None, ge=1)

    @property
    def time_limit(self) -> float:
        """Seconds one run of this job may train."""
        return self.max_train_seconds if self.max_train_seconds is not None else float(self.train_args.timeout)

    @field_validator("job_id")
    @classmethod
    def _safe_id(cls, v: str) -> str:
        return check_name(v, "job_id")


class JobStatus(BaseModel):
    """`jobs/<id>/status.json`: QUEUED -> RUNNING -> COMPLETED | FAILED | CANCELLED, with the reason."""

    job_id: str
    status: JobState = "QUEUED"
    reason: str | None = None
    step: int = 0
    max_steps: int = 0
    loss: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    updated: float | None = None
    launcher: str | None = None
    launcher_id: str | None = None
    # How many times the job was relaunched from its saved state (after a shutdown, a crash, or by hand).
    resumes: int = 0
    # Trainer-reported facts about the run (e.g. data: rows, truncated_rows, dropped_rows, global_batch_blocks).
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATES


class CheckpointManifest(BaseModel):
    """`checkpoints/step-<N>/manifest.json`: a checkpoint describes itself."""

    job_id: str
    step: int
    base_model: str
    kind: Literal["full", "lora"]
    created: float = 0.0
    loss: float | None = None
    extra: dict[str, Any] = Field(default_factory=dict)


class TrainResponse(BaseModel):
    """POST /v1/megatron/train answer (ScalarLM shape: job_status, job_config, deployed)."""

    job_status: dict[str, Any]
    job_config: dict[str, Any]
    deployed: bool = False


class ModelEntry(BaseModel):
    """One servable model in /v1/megatron/list_models (ScalarLM keys plus version)."""

    name: str
    deployed: bool = False
    status: str | None = None
    # Numbers always (ScalarLM's SDK CLI formats every `*time*` key): 0 for the base model, a queued job's submission
    # time until it starts; train_time 0 until it starts.
    start_time: float = 0.0
    step: int | None = None
    max_steps: int | None = None
    train_time: float = 0.0
    loss: float | None = None
    version: int = 0
    kind: Literal["base", "full", "lora"] = "base"


class ListModelsResponse(BaseModel):
    models: list[ModelEntry]


class TrainingJobResponse(TrainResponse):
    """GET /v1/megatron/train/{job_id}: status (with ScalarLM's loss `history`), config, checkpoints, last metrics."""

    checkpoints: list[int] = Field(default_factory=list)
    metrics_count: int = 0
    last_metrics: dict[str, Any] | None = None


class UploadInitRequest(BaseModel):
    """POST /v1/megatron/upload/init, as the ScalarLM SDK sends it for archives above its single-POST threshold."""

    total_size: int = Field(ge=1)
    total_hash: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    chunk_size: int = Field(ge=1)
    num_chunks: int = Field(ge=1)
    compressed: bool = True
    params: dict[str, Any] = Field(default_factory=dict)


class UploadInitResponse(BaseModel):
    """The session id and the chunks already received (a re-sent init resumes the same upload)."""

    upload_id: str
    received_chunks: list[int] = Field(default_factory=list)


class UploadChunkResponse(BaseModel):
    upload_id: str
    chunk_index: int
    received_chunks: int


class UploadFinalizeRequest(BaseModel):
    upload_id: str


class DeleteJobResponse(BaseModel):
    job_id: str
    deleted: bool = True


class GpuCountResponse(BaseModel):
    gpu_count: int


class NodeCountResponse(BaseModel):
    node_count: int


# ---- RL sessions and published versions (issue 4) ------------------------------------------------


class RLRow(BaseModel):
    """One scored completion for GRPO: the rows of one `group` (default: the prompt) are normalised together.

    `logprobs` are the sampling logprobs of the completion tokens as returned by generate (request `logprobs`);
    without them the trainer uses its own current logprobs (ratio 1, on-policy). `completion_token_ids` are the
    sampled token ids (generate's `token_ids`): with them the trainer trains on exactly the tokens sampled, one
    logprob each, instead of re-tokenizing `completion` (which may split the text differently).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN reward or logprob would poison the step

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    completion: str
    reward: float
    group: str | None = None
    logprobs: list[float] | None = None
    completion_token_ids: list[int] | None = None
    # Why generation stopped (generate's `finish_reason`: "stop", or "length" at max_tokens); read by train arg
    # `mask_truncated_completions`.
    finish_reason: str | None = None
    # The weights version that generated this completion (generate's `version`); the step's staleness is
    # measured from the oldest version among its rows and the step request's `version`.
    version: int | None = Field(None, ge=0)

    def group_key(self) -> str:
        """The row's group: its `group`, else its prompt (or messages) text."""
        if self.group is not None:
            return self.group
        if self.prompt is not None:
            return self.prompt
        return json.dumps(self.messages, sort_keys=True)


class SessionCreateRequest(BaseModel):
    """POST /v1/train/sessions: start a long-lived trainer that takes one optimizer step per submitted batch.

    `max_staleness`: how many versions older than the weights it trains a batch may be generated with (1: the
    client generates batch k+1 while step k trains; 0: every batch is generated with the newest weights, and
    steps run one at a time as a synchronous loop). Up to `max_staleness + 1` steps may be in flight.
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = None
    train_args: dict[str, Any] = Field(default_factory=dict)
    max_staleness: int = Field(1, ge=0)
    stale_policy: StalePolicy = "refuse"


class SessionStepRequest(BaseModel):
    """POST /v1/train/sessions/{id}/step (or .../steps): rows for one optimizer step (SFT rows or scored RL rows).

    `version`: the weights version the rows were generated with (generate results carry it); None: unknown,
    unless the rows carry their own `version`, and then no staleness bound applies.
    """

    model_config = ConfigDict(extra="forbid")

    rows: list[dict[str, Any]] = Field(..., min_length=1)
    version: int | None = Field(None, ge=0)
    wait_seconds: float = Field(600.0, ge=0)
    # Whether the client generates (its next batch) while this step trains. A CPU trainer beside its CPU engine then
    # leaves the engine half the cores, and otherwise takes them all. None: true for a submitted step (.../steps),
    # false for one the client waits on (.../step).
    overlap: bool | None = None


class SessionRequestMeta(BaseModel):
    """`jobs/<id>/session/meta-<k>.json`, written by the control plane just before `request-<k>.jsonl`."""

    version: int | None = None
    accepted: float = 0.0
    # The request's `overlap`, resolved (None: written by an older control plane; the trainer treats it as true).
    overlap: bool | None = None


class SessionStepResult(BaseModel):
    """`jobs/<id>/session/result-<k>.json`, written by the trainer after step k is published (or refused)."""

    step: int
    version: int
    loss: float | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    # "stale": refused for staleness (409); any other error is a bad batch (400).
    error_type: str | None = None
    request: int | None = None
    # The version that generated the batch, and how many versions older it was than the weights it trained.
    generated_version: int | None = None
    staleness: int | None = None
    # Wall-clock (time.time) when the trainer took up the request and when it wrote this result.
    started: float | None = None
    finished: float | None = None


class SessionResponse(BaseModel):
    session_id: str
    model_name: str
    status: str
    version: int = 0
    # Why the session ended (e.g. idle for `training.session_idle_seconds`), when it has.
    reason: str | None = None
    max_staleness: int = 1
    stale_policy: StalePolicy = "refuse"


class PublishedNotice(BaseModel):
    """Trainer -> control plane: a step was published (the file poll of `checkpoints/latest` is the fallback)."""

    job_id: str
    step: int


class SessionStepResponse(BaseModel):
    """POST /v1/train/sessions/{id}/step answer: the version this step published (the newest, unless a step
    queued after it finished first), the version that generated its batch and the staleness it trained with."""

    session_id: str
    model_name: str
    step: int
    version: int
    loss: float | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    request: int | None = None
    generated_version: int | None = None
    staleness: int | None = None


class SessionStepState(BaseModel):
    """POST /v1/train/sessions/{id}/steps (accepted at once) and GET .../steps/{request}: where a step stands.

    `state` is "queued" (written, waiting for or in training) or "trained" (`result` holds the answer a
    blocking step gives); a refused step answers its error (409 stale, 400 bad batch) instead.
    """

    session_id: str
    request: int
    state: Literal["queued", "trained"]
    accepted: float
    result: SessionStepResponse | None = None
