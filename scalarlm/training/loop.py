"""The training loop on a megatron-core model: read top to bottom (data, model, optimizer, resume, steps).

Full weights or LoRA (`adapter_type`; LoRA freezes the base and publishes a PEFT adapter, see lora.py). The loss is
SFT, or GRPO / Dr. GRPO over whole groups of scored rows (`loss`, see grpo.py and rl_step.py). Session jobs use
the same Trainer, driven one request at a time by session_loop.py.

Global batch (blocks per optimizer step) = batch_size * gradient_accumulation_steps * DP, where a block is one
packed sequence of at most `max_seq_len` tokens (ScalarLM's `max_token_block_size` is the same length). bf16 on GPU
unless `dtype` is float32; fp32 on CPU. Publishes a servable checkpoint every `steps_per_publish` steps (default:
`steps_per_checkpoint`), saves resume state every `steps_per_checkpoint` steps, and does both at the end (staged on
the serving host, a `steps_per_publish` step that a newer one overtakes before its durable copy lands is served but
never lands: checkpoint/staging.py; every `steps_per_checkpoint` step and the last one land). A resumed
job does not publish again the steps its earlier run already published (it retrains them exactly), so the served
version never moves back.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scalarlm.checkpoint import JobDir, latest_step, publish_step
from scalarlm.checkpoint.staging import STAGING_ENV, StagedPublisher
from scalarlm.protocol.training import CheckpointManifest, TrainJobConfig
from scalarlm.training import hf_io
from scalarlm.training.convert import mark_tensor_parallel
from scalarlm.training import lora
from scalarlm.training.data import BlockStream, DataStats, MicroBatch, StepBatch, encode_rows, step_batch
from scalarlm.training.export import publish_checkpoint
from scalarlm.training.grpo import GroupStream
from scalarlm.training.rl_step import RLBatch, grpo_step, rl_batch
from scalarlm.training.losses import sft_loss
from scalarlm.training.notify import notify_published
from scalarlm.training.families import check_moe_training, expert_rank
from scalarlm.training.model import build_gpt_model, half_precision, model_arch, sequence_parallel
from scalarlm.training.moe_balance import BalanceMeter
from scalarlm.training.moe_replay import RoutingReplay
from scalarlm.training.optim import build_optimizer, wrap_data_parallel
from scalarlm.training.parallel import Parallel
from scalarlm.training.rows import Row
from scalarlm.training.schedule import lr_at
from scalarlm.training.shard_load import load_rank_params
from scalarlm.training.step import run_step
from scalarlm.training.state import latest_state, load_state, save_state

logger = logging.getLogger(__name__)


class Trainer:
    """One rank's share of an SFT job: model shard, optimizer, data stream and step counter."""

    def __init__(
        self, job: JobDir, config: TrainJobConfig, par: Parallel, rows: list[Row], rl_rows: list[dict] | None = None
    ) -> None:
        from transformers import AutoTokenizer

        self.job, self.config, self.par = job, config, par
        self.args = args = config.train_args
        self.base = Path(config.base_model)
        self.base_config = hf_io.read_config(self.base)
        # This rank's view of the model: with expert parallelism, its share of the experts (numbered locally).
        self.arch = expert_rank(model_arch(self.base), par.ep_rank, par.ep_size)
        if args.disable_dropout:
            self.arch = replace(self.arch, attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0)
        check_moe_training(self.arch, args.moe_aux_loss_coef, args.routing_replay)
        self.bf16 = par.on_gpu and args.dtype != "float32"

        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(self.base)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_len = args.max_seq_len  # TrainArgs sets it to max_token_block_size when that is sent
        self.global_batch = args.batch_size * args.gradient_accumulation_steps * par.dp_size
        self.data_stats = DataStats()
        self.stream: BlockStream | None = None
        self.groups: GroupStream | None = None
        if rl_rows is not None:
            self.groups = GroupStream.from_rows(rl_rows, args.shuffle, args.seed)
            self.data_stats = DataStats(rows=len(rl_rows), documents=len(rl_rows))
        elif not config.session:
            docs, self.data_stats = encode_rows(tokenizer, rows, self.max_len)
            self.stream = BlockStream(docs, self.max_len, args.pack, args.shuffle, args.seed)

        self.lora = args.adapter_type == "lora"
        self.model = self._build_model()
        if self.lora:
            lora.attach_lora(self.model, self.arch, args.lora_config, par.tp_rank, par.tp_size, args.seed)
            if args.gradient_checkpointing:
                lora.recompute_reaches_adapters(self.model)
        # The KL reference of full-weight training is a frozen copy of the base (LoRA: adapters disabled).
        self.ref_model = None
        if not self.lora and args.loss != "sft" and args.kl_coef > 0:
            # Frozen by running only under no_grad (rl_step._reference_logp), never by requires_grad=False: megatron's
            # frozen-weight linear rounds differently at TP=2 (2.4e-6 in a packed row's logprob, measured), which
            # turns step 1's zero KL gradient into noise that Adam's first step spreads over every near-zero grad.
            self.ref_model = self._build_model(trained=False).eval()
        # Every step's metrics carry the MoE load-balancing loss (dense models: none); GRPO over several steps per
        # batch records the first step's expert choices (and replays them with `routing_replay`).
        self.balance = BalanceMeter(self.model) if self.arch.num_experts else None
        self.routing = None
        if self.arch.num_experts and args.num_iterations > 1:
            self.routing = RoutingReplay(self.model, args.routing_replay)
        self.rl_batch: RLBatch | None = None
        self.batch_start: dict[str, int] = {}  # the group stream's state before the current batch
        # Overlapped grad all-reduce (DP > 1) for every loss: the step driver (step.py) runs all but each step's last
        # micro-batch under no_sync(), and Tinker's forward_backward all of them (its optim_step starts the sync).
        self.ddp = wrap_data_parallel(self.model if not self.bf16 else half_precision(self.model), par, overlap=True)
        self.optimizer = build_optimizer(self.ddp, args, par, self.bf16)
        self.step = 0
        self.tokens_seen = 0
        # The newest step this job already published (an earlier run of it, before a stop or crash).
        self.published = latest_step(job) or 0
        # Full weights on the serving host: rank 0 stages each step in memory and lands the durable copy while the
        # next step trains (checkpoint/staging.py); announced twice, staged and landed.
        staging = os.environ.get(STAGING_ENV)
        self.publisher = None
        if staging and par.is_main and not self.lora:
            self.publisher = StagedPublisher(job, Path(staging), lambda step: notify_published(config.job_id, step),
                                             sum(f.stat().st_size for f in self.base.glob("*.safetensors")),
                                             keep=args.max_checkpoints_to_keep)  # fmt: skip

    def _build_model(self, trained: bool = True) -> torch.nn.Module:
        """The GPTModel shard of this TP rank, loaded from the base HF checkpoint (`trained`: False for the frozen
        KL reference, which runs without autograd and so needs no activation recompute)."""
        recompute = trained and self.args.gradient_checkpointing
        model = build_gpt_model(self.arch, self.par.tp_size, self.bf16, recompute=recompute,
                                aux_loss_coef=self.args.moe_aux_loss_coef if trained else 0.0,
                                sequence_parallel=sequence_parallel(self.arch, self.par.tp_size))  # fmt: skip
        # Each rank reads only the slices of the HF tensors its shard holds (no full copy of the model).
        mcore, read = load_rank_params(self.base, self.arch, self.par.tp_rank, self.par.tp_size)
        logger.info("rank %d read %d of %d checkpoint bytes", self.par.rank, read["bytes_read"], read["stored_bytes"])
        params = dict(model.named_parameters())
        if set(params) != set(mcore):
            raise RuntimeError(f"converter/model mismatch: {sorted(set(params) ^ set(mcore))[:4]}")
        with torch.no_grad():
            for name, value in mcore.items():
                params[name].copy_(value)
        del mcore
        mark_tensor_parallel(model, self.arch)
        return model.to(self.par.device)

    def resume_if_saved(self) -> bool:
        """Continue from `state/` if it holds a saved state; True if it did."""
        saved = latest_state(self.job.state_dir)
        if saved is None:
            return False
        payload = load_state(saved, self.par, self.model, self.optimizer)
        self.step = int(payload["step"])
        self.tokens_seen = int(payload.get("tokens_seen", 0))
        data = self.stream or self.groups
        if data is not None:
            data.load_state_dict(payload["data"])
        return True

    def save(self) -> None:
        """Collectively save resume state after `self.step` completed steps."""
        self.finish_publishing()  # a saved state's step has its durable checkpoint
        data = self.stream or self.groups
        state = data.state_dict() if data else {}
        if self.groups is not None and self.step % self.args.num_iterations:
            state = self.batch_start  # inside a batch's iterations: resume takes the batch again
        extra = {"data": state, "tokens_seen": self.tokens_seen}
        save_state(self.job.state_dir, self.step, self.par, self.model, self.optimizer, extra)

    def publish(self, loss: float | None, serving: bool = False) -> None:
        """Collectively publish `checkpoints/step-<step>/` (full weights or a PEFT adapter); rank 0 notifies.

        `serving`: published to serve the newest weights (a session step, a `steps_per_publish` step). Staged, such a
        step is supersedable unless it is a `steps_per_checkpoint` step: a newer step staged before its durable copy
        began to land lands instead of it (checkpoint/staging.py)."""
        manifest = CheckpointManifest(
            job_id=self.config.job_id,
            step=self.step,
            base_model=str(self.config.base_model),
            kind="lora" if self.lora else "full",
            loss=loss,
            extra={"adapter_type_requested": self.args.adapter_type, "dtype": "bfloat16" if self.bf16 else "float32"},
        )
        if self.lora:
            self._publish_adapter(manifest)
        else:
            publish = partial(publish_step, keep=self.args.max_checkpoints_to_keep)
            if self.publisher is not None:
                supersedable = serving and self.step % self.args.steps_per_checkpoint != 0
                publish = partial(self.publisher.publish, supersedable=supersedable)
            publish_checkpoint(self.job, self.model, self.arch, self.par, self.base, self.base_config, manifest,
                               self.args.publish_dtype, publish)
        self.published = self.step
        if self.par.is_main:
            notify_published(self.config.job_id, self.step)

    def finish_publishing(self) -> None:
        """Wait for the durable copy of the newest staged step (rank 0; a no-op without staging); raise its error."""
        if self.publisher is not None:
            self.publisher.wait()

    def _publish_adapter(self, manifest: CheckpointManifest) -> None:
        """Rank 0 writes the adapter (every rank holds the full, identical A/B) with the tokenizer files."""
        if self.par.is_main:
            state = lora.peft_state(self.model, self.arch)
            if self.args.publish_dtype != "source":  # "source": float32, PEFT's own default for adapter weights
                dtype = getattr(torch, self.args.publish_dtype)
                state = {k: v.to(dtype) for k, v in state.items()}
            config = lora.peft_config(self.args.lora_config, self.arch, str(self.config.base_model))
            path = publish_step(self.job, manifest, lambda dest: lora.write_adapter(dest, state, config, self.base),
                                self.args.max_checkpoints_to_keep)  # fmt: skip
            logger.info("published adapter %s", path)
        dist.barrier()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over the next global batch; returns its metrics row."""
        args, par = self.args, self.par
        if self.groups is not None:  # GRPO: `batch_size * gradient_accumulation_steps` whole groups per step
            # `num_iterations` steps per batch; a job resumed inside a batch takes it again and starts its first pass
            if self.rl_batch is None or self.step % args.num_iterations == 0:
                self.batch_start = self.groups.state_dict()
                self.rl_batch = rl_batch(self, self.groups.take(args.batch_size * args.gradient_accumulation_steps))
            return grpo_step(self, self.rl_batch)
        assert self.stream is not None
        batch = step_batch(
            self.stream.take(self.global_batch),
            args.batch_size,
            args.gradient_accumulation_steps,
            par.dp_size,
            par.dp_rank,
            self.pad_id,
            packed=True,  # padding-free rows: compute only on real tokens
        )
        return self.sft_step(batch)

    def optimizer_step(self) -> tuple[float, float]:
        """Step the optimizer at this step's LR (LoRA grads summed over TP once the DP sync has finished, the same
        order on every rank); returns (lr, grad norm)."""
        par = self.par
        sum_lora = partial(lora.allreduce_lora_grads, self.model, par.tp_group, par.tp_size) if self.lora else None
        lr = lr_at(self.step, self.args)
        return lr, self.optimizer.step(lr, after_sync=sum_lora)

    def sft_step(self, batch: StepBatch) -> dict[str, Any]:
        """One optimizer step of the SFT loss over this rank's share of `batch`; returns its metrics row."""

        def loss_fn(i: int, micro: MicroBatch, token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = sft_loss(token_loss, micro.loss_mask, batch.global_loss_tokens)
            return loss, loss.detach().reshape(1)

        result = run_step(self, batch.micro_batches, loss_fn, n_stats=1)
        self.tokens_seen += batch.global_tokens
        return {
            "step": self.step,
            "loss": float(result.sums[0]),
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": batch.global_tokens,
            "loss_tokens": batch.global_loss_tokens,
            "tokens_per_second": batch.global_tokens / result.seconds if result.seconds > 0 else 0.0,
            "step_seconds": result.seconds,
            "epoch": self.stream.epoch if self.stream else 0,
            "tokens_seen": self.tokens_seen,
            "time": time.time(),
            **result.moe,
        }

    def data_report(self) -> dict[str, Any]:
        """Data counts for status and metrics (rows truncated / dropped, documents, global batch)."""
        return {**asdict(self.data_stats), "global_batch_blocks": self.global_batch, "max_seq_len": self.max_len}


def should_stop(local_flag: bool, device: torch.device) -> bool:
    """True on every rank if any rank was asked to stop (so all stop at the same step boundary)."""
    flag = torch.tensor([1 if local_flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run(
    trainer: Trainer,
    stop_requested: Callable[[], bool],
    on_step: Callable[[dict[str, Any]], None],
) -> str:
    """Train until max_steps or a stop request; return "completed" or "stopped" (state saved either way)."""
    args = trainer.args
    if trainer.step >= args.max_steps:
        return "completed"  # resumed a finished job: its final checkpoint is already published
    loss = None
    while trainer.step < args.max_steps:
        if should_stop(stop_requested(), trainer.par.device):
            trainer.save()
            return "stopped"
        metrics = trainer.train_step()
        loss = metrics["loss"]
        on_step(metrics)
        if trainer.step >= args.max_steps:
            break
        if trainer.step % args.publish_every == 0 and trainer.step > trainer.published:
            trainer.publish(loss, serving=True)
        if trainer.step % args.steps_per_checkpoint == 0:
            trainer.save()
    trainer.publish(loss)
    trainer.save()
    return "completed"
