"""Session mode: the model and optimizer stay in memory; one optimizer step per submitted request file.

Loop (every rank): wait for `session/request-<k>.jsonl` (ranks agree collectively), take one step (GRPO if
`train_args.loss` is grpo/dr_grpo/dapo, else SFT; both padding-free through the step driver, step.py), publish
`checkpoints/step-<version>`, and rank 0 writes `session/result-<k>.json`. A bad batch yields a result with `error`
and no step. `session/end` ends the session (COMPLETED); SIGTERM / cancel stop it like a normal job (state saved),
and a step request saves it every `steps_per_checkpoint` steps. Request k follows the last result written, so a
restarted (resumed) session continues where it stopped; after a crash it continues from its last saved state with
the version after its newest published one (`continue_versions`).

The poll runs every 15 ms right after a step and backs off in proportion to the idle time (at most 2% of it, up
to 0.5 s), so a client computing rewards for seconds pays little and an idle trainer costs nearly nothing.

Staleness: a request's batch was generated with the oldest version among `meta-<k>.json`'s and its rows'
`version`; it trains the weights at version `trainer.step`. Beyond `session_max_staleness` versions older it is
refused (an error result of type "stale"), or with `session_stale_policy` "reweight" trained as usual, which for
GRPO means the clipped importance ratio exp(logp - logp_sampling) against the sampling logprobs every row must
then carry. Each step's metrics row records `generated_version`, `trained_version` and `staleness`. After
`session_idle_seconds` (job config, from `training.session_idle_seconds`) without a request the session ends itself
like a cancel: state saved, the last published step stays servable, CANCELLED with the idle reason; resuming the
job continues it.

Threads: a CPU rank beside its CPU engine takes half the cores for a step the client generates beside (the
request's `overlap`, in its meta) and all its share for one the client waits on; the metrics row says which.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import ValidationError

from scalarlm.checkpoint.session import SessionDir, batch_version, stale_message
from scalarlm.protocol.errors import Conflict, InvalidRequest, ScalarLMError
from scalarlm.protocol.training import SessionStepResult
from scalarlm.training.data import StepBatch, encode_rows, pack, spread_batch
from scalarlm.training.rl_step import grpo_step, rl_batch
from scalarlm.training.rows import parse_row
from scalarlm.training.tinker_ops import is_op_request, run_op

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.015
MAX_POLL_SECONDS = 0.5
# The poll interval grows to this fraction of the time since the last request (bounded by the two above).
POLL_BACKOFF = 0.02


def poll_interval(idle_seconds: float) -> float:
    """How long to sleep before looking for the next request, after `idle_seconds` without one."""
    return min(MAX_POLL_SECONDS, max(POLL_SECONDS, idle_seconds * POLL_BACKOFF))


def sft_batch(trainer: "Trainer", raw_rows: list[dict[str, Any]]) -> StepBatch:
    """All of `raw_rows` as one global SFT batch (packed, padding-free), split into this DP rank's micro-batches."""
    rows = [parse_row(json.dumps(r), i + 1) for i, r in enumerate(raw_rows)]
    docs, _ = encode_rows(trainer.tokenizer, rows, trainer.max_len)
    blocks = pack(docs, range(len(docs)), trainer.max_len, trainer.args.pack)
    par = trainer.par
    return spread_batch(blocks, trainer.args.batch_size, par.dp_size, par.dp_rank, trainer.pad_id, even=par.ep_size > 1)


def session_step(trainer: "Trainer", raw_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer step on one request's rows (GRPO or SFT per `train_args.loss`)."""
    if trainer.args.loss != "sft":
        return grpo_step(trainer, rl_batch(trainer, raw_rows))
    return trainer.sft_step(sft_batch(trainer, raw_rows))


def _next_request(files: SessionDir) -> int:
    """1 + the highest request index that already has a result."""
    done = [int(p.stem.split("-")[1]) for p in files.root.glob("result-*.json")]
    return max(done, default=0) + 1


def _agree(flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise: stop / idle = any rank; request ready / end = every rank sees it."""
    stop, ready, end, idle = flags
    t = torch.tensor([int(stop), -int(ready), -int(end), int(idle)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [t[0].item() > 0, t[1].item() < 0, t[2].item() < 0, t[3].item() > 0]


def idle_reason(limit: float, step: int) -> str:
    """The status reason of a session that ended itself for lack of requests."""
    return (f"session idle for {limit:g} s without a step request (training.session_idle_seconds); "
            f"state saved at step {step}, its weights stay servable; resume the job to continue")  # fmt: skip


def run_session(
    trainer: "Trainer",
    stop_requested: Callable[[], bool],
    on_step: Callable[[dict[str, Any]], None],
) -> str:
    """Serve step requests until `end` ("completed"), a stop request ("stopped") or `session_idle_seconds` without a
    request ("idle": rank 0 leaves the cancel marker with the reason, so the job ends CANCELLED); state is saved."""
    files = SessionDir(trainer.job)
    files.create()
    k = _next_request(files)
    continue_versions(trainer)
    limit = trainer.config.session_idle_seconds or None
    logger.info("session %s: waiting for request %d (idle limit %s)", trainer.job.job_id, k,
                f"{limit:g} s" if limit else "none")  # fmt: skip
    last_request = time.monotonic()
    while True:
        waited = time.monotonic() - last_request
        stop, ready, end, idle = _agree(
            [stop_requested(), files.request_path(k).exists(), files.end_requested(), bool(limit and waited >= limit)],
            trainer.par.device,
        )
        if stop:
            trainer.save()
            return "stopped"
        if ready:
            _serve(trainer, files, k, on_step)
            k += 1
            last_request = time.monotonic()
            continue
        if end:
            trainer.save()
            return "completed"
        if idle:
            reason = idle_reason(limit or 0.0, trainer.step)
            logger.warning("session %s: %s", trainer.job.job_id, reason)
            if trainer.par.is_main:
                trainer.job.cancel_marker.write_text(reason + "\n")
            trainer.save()
            return "idle"
        time.sleep(poll_interval(waited))


def continue_versions(trainer: "Trainer") -> None:
    """A session resumed from a state older than its newest published step (its trainer died between two saves)
    continues from that state, and its next step publishes the version after the newest one: versions only grow,
    and no published step is written again with other weights. The steps in between are lost (logged)."""
    if trainer.step >= trainer.published:
        return
    logger.warning("session %s: resumed from the state saved at step %d, older than its published version %d; the "
                   "%d step(s) between are lost, and its next step is version %d", trainer.job.job_id, trainer.step,
                   trainer.published, trainer.published - trainer.step, trainer.published + 1)  # fmt: skip
    trainer.step = trainer.published


def check_staleness(trainer: "Trainer", rows: list[dict[str, Any]], generated: int | None) -> None:
    """Refuse a batch beyond the staleness bound of the weights about to train (`trainer.step`): Conflict, unless
    re-weighting applies (GRPO rows that all carry sampling logprobs); InvalidRequest for a version from the future."""
    if generated is None:
        return
    current, config = trainer.step, trainer.config
    if generated > current:
        raise InvalidRequest(f"batch generated with version {generated}, but the session's weights are at version "
                             f"{current}", param="version")  # fmt: skip
    if current - generated <= config.session_max_staleness:
        return
    message = stale_message(trainer.job.job_id, generated, current, config.session_max_staleness)
    if config.session_stale_policy == "refuse":
        raise Conflict(message, param="version")
    if trainer.args.loss == "sft":
        raise Conflict(f"{message} (stale_policy 'reweight' applies to GRPO sessions only)", param="version")
    missing = [i for i, r in enumerate(rows) if not r.get("logprobs")]
    if missing:
        raise Conflict(f"{message}: re-weighting needs the sampling logprobs of every row; rows {missing[:8]} "
                       "have none", param="version")  # fmt: skip


def _serve(trainer: "Trainer", files: SessionDir, k: int, on_step: Callable[[dict[str, Any]], None]) -> None:
    """Train on request k, publish, and write its result (an error result for a bad or too stale batch)."""
    started = time.time()
    current = trainer.step
    generated = staleness = None
    rows = files.read_request(k) or []
    meta = files.read_meta(k)
    # A CPU rank leaves its engine half the cores while the client generates beside this step (unknown: it may).
    threads = trainer.par.use_cpu_threads(overlapped=meta.overlap is not False)
    if is_op_request(rows):
        _serve_op(trainer, files, k, rows[0], on_step, started)
        return
    try:
        generated = batch_version(meta.version, rows)
        staleness = None if generated is None else current - generated
        check_staleness(trainer, rows, generated)
        metrics = session_step(trainer, rows)
    except (ScalarLMError, ValidationError, ValueError, KeyError, TypeError) as e:
        logger.warning("session request %d rejected: %s", k, e)
        if trainer.par.is_main:
            files.write_result(k, SessionStepResult(
                step=trainer.step, version=trainer.step, error=str(getattr(e, "message", None) or e),
                error_type="stale" if isinstance(e, Conflict) else "invalid", request=k, generated_version=generated,
                staleness=staleness, started=started, finished=time.time(),
            ))  # fmt: skip
        return
    stale_limit = trainer.config.session_max_staleness
    metrics.update(request=k, generated_version=generated, trained_version=current, staleness=staleness,
                   reweighted=staleness is not None and staleness > stale_limit)  # fmt: skip
    if threads:
        metrics["cpu_threads"] = threads
    on_step(metrics)
    trainer.publish(metrics["loss"], serving=True)
    if trainer.par.is_main:
        files.write_result(k, SessionStepResult(
            step=trainer.step, version=trainer.step, loss=metrics["loss"], metrics=_plain(metrics), request=k,
            generated_version=generated, staleness=staleness, started=started, finished=time.time(),
        ))  # fmt: skip
    if trainer.step % trainer.args.steps_per_checkpoint == 0:
        trainer.save()  # as a job does: a crash loses at most `steps_per_checkpoint` steps


def _serve_op(trainer: "Trainer", files: SessionDir, k: int, request: dict[str, Any],
              on_step: Callable[[dict[str, Any]], None], started: float) -> None:
    """A Tinker primitive (tinker_ops.py): its outputs go in the result's metrics; a bad one is an error result."""
    try:
        answer = run_op(trainer, request)
    except (ScalarLMError, ValidationError, ValueError, KeyError, TypeError) as e:
        logger.warning("session request %d (%s) rejected: %s", k, request.get("op"), e)
        if trainer.par.is_main:
            files.write_result(k, SessionStepResult(
                step=trainer.step, version=trainer.step, error=str(getattr(e, "message", None) or e),
                error_type="invalid", request=k, started=started, finished=time.time(),
            ))  # fmt: skip
        return
    if request.get("op") == "optim_step":
        on_step({"step": trainer.step, "loss": answer["loss"], "tokens_per_second": 0.0, "time": time.time(),
                 **answer["metrics"]})  # fmt: skip
    if trainer.par.is_main:
        files.write_result(k, SessionStepResult(
            step=trainer.step, version=answer.get("version", trainer.step), loss=answer.get("loss"),
            metrics={"op": request.get("op"), **answer}, request=k, started=started, finished=time.time(),
        ))  # fmt: skip


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
