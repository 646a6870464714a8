"""Operator commands over the client (ScalarLM's SDK CLI and more): ls, logs, plot, squeue, stats, cancel, resume,
delete, clear-queue, train, models, export.

Each command is a thin call of `scalarlm.client.ScalarLM` (same URL and key resolution as the client) that prints a
table for people or, with `--json`, the server's JSON for scripts. Any error is one line on stderr naming the
server's message, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scalarlm.protocol.training import MAX_STEPS

if TYPE_CHECKING:
    from scalarlm.client import ScalarLM

Command = Callable[["ScalarLM", argparse.Namespace], Any]
LS_DEFAULT_ROWS = 10
FOLLOW_POLL_SECONDS = 1.0


# --- output ---------------------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A table cell: floats with 4 decimals, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def progress(step: int | None, max_steps: int | None) -> str:
    """`step/max_steps`, or the step alone for an open-ended RL session (its max_steps is the MAX_STEPS ceiling)."""
    if max_steps is None or max_steps >= MAX_STEPS:
        return str(step or 0)
    return f"{step or 0}/{max_steps}"


def when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=1, default=str) if args.json else human(data))


# --- commands -------------------------------------------------------------------------------------------------------


def run_ls(llm: ScalarLM, args: argparse.Namespace) -> None:
    models = llm.list_models()["models"]
    jobs = [m for m in models if m.get("kind") != "base"]
    shown = models if args.all else jobs[:LS_DEFAULT_ROWS]  # newest first
    _emit(args, shown, lambda rows: table(
        ["model", "status", "step", "loss", "version", "kind", "started"],
        [[m["name"], m.get("status"), progress(m.get("step"), m.get("max_steps")), m.get("loss"),
          m.get("version"), m.get("kind"), when(m.get("start_time"))] for m in rows],
    ))  # fmt: skip


def run_models(llm: ScalarLM, args: argparse.Namespace) -> None:
    models = [m for m in llm.list_models()["models"] if m.get("kind") == "base" or m.get("deployed")]
    _emit(args, models, lambda rows: table(
        ["model", "kind", "version", "status"], [[m["name"], m["kind"], m["version"], m.get("status")] for m in rows]))


def run_logs(llm: ScalarLM, args: argparse.Namespace) -> None:
    text = llm.get_logs(args.job)
    if args.json:
        print(json.dumps({"job_id": args.job, "logs": text}))
        return
    sys.stdout.write(text)
    if not args.follow:
        return
    while not llm.get_training_job(args.job).status().terminal:
        time.sleep(FOLLOW_POLL_SECONDS)
        newer = llm.get_logs(args.job)
        sys.stdout.write(newer[len(text):] if newer.startswith(text) else newer)
        sys.stdout.flush()
        text = newer
    newer = llm.get_logs(args.job)
    sys.stdout.write(newer[len(text):] if newer.startswith(text) else "")


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1: unchanged)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_plot(llm: ScalarLM, args: argparse.Namespace) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = [row for row in llm.get_training_job(args.job).metrics() if "step" in row]
    series = {"loss": [(r["step"], r["loss"]) for r in metrics if r.get("loss") is not None]}
    rewards = [(r["step"], r.get("reward_mean", r.get("reward"))) for r in metrics]
    series["reward"] = [(s, v) for s, v in rewards if v is not None]
    series = {k: v for k, v in series.items() if v}
    if not series:
        raise ValueError(f"training job {args.job} has no loss values to plot yet")
    fig = Figure(figsize=(7, 4 if len(series) == 1 else 6), dpi=100)
    FigureCanvasAgg(fig)
    for i, (name, points) in enumerate(series.items()):
        ax = fig.add_subplot(len(series), 1, i + 1)
        steps, values = [s for s, _ in points], [v for _, v in points]
        if args.smooth > 1:
            ax.plot(steps, values, alpha=0.3, color="C%d" % i)
        ax.plot(steps, smooth(values, args.smooth), color="C%d" % i, label=name)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    fig.suptitle(f"{args.job}" + (f" (smoothed over {args.smooth})" if args.smooth > 1 else ""))
    fig.tight_layout()
    out = Path(args.output or f"{args.job}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "png")
    _emit(args, {"path": str(out), "points": len(metrics)}, lambda d: d["path"])


def run_squeue(llm: ScalarLM, args: argparse.Namespace) -> None:
    _emit(args, llm.squeue()["jobs"], lambda rows: table(
        ["job", "status", "launcher", "launcher_id", "processes", "step", "started"],
        [[j["job_id"], j["status"], j.get("launcher"), j.get("launcher_id"), j["state"],
          progress(j["step"], j["max_steps"]), when(j.get("start_time"))] for j in rows],
    ))  # fmt: skip


def run_stats(llm: ScalarLM, args: argparse.Namespace) -> None:
    data = {"health": llm.health(), "queue": llm.metrics(), "workers": llm.workers()["workers"]}

    def human(d: dict[str, Any]) -> str:
        q = d["queue"]
        counts = q.get("queue", {})
        lines = [f"health: api {d['health'].get('api')}, vllm {d['health'].get('vllm')}",
                 table(["queued", "leased", "completed", "failed", "depth", "requests/s", "tokens/s", "total tokens"],
                       [[counts.get("queued"), counts.get("leased"), counts.get("completed"), counts.get("failed"),
                         q.get("queue_depth"), q.get("requests_per_second"), q.get("tokens_per_second"),
                         q.get("total_tokens")]]), ""]  # fmt: skip
        lines.append(table(["worker", "seen", "holding", "loaded", "running", "waiting", "kv_cache"], [
            [w["worker_id"], when(w["last_seen"]), w.get("holding"),
             ", ".join(f"{k}:v{v}" for k, v in w["loaded"].items()) or "-",
             (w.get("load") or {}).get("running"), (w.get("load") or {}).get("waiting"),
             (w.get("load") or {}).get("kv_cache_usage")] for w in d["workers"]]))  # fmt: skip
        return "\n".join(lines)

    _emit(args, data, human)


def _status_line(status: Any) -> str:
    body = status.model_dump() if hasattr(status, "model_dump") else status
    return f"{body['job_id']}: {body['status']}" + (f" ({body['reason']})" if body.get("reason") else "")


def run_cancel(llm: ScalarLM, args: argparse.Namespace) -> None:
    _emit(args, llm.cancel(args.job).model_dump(mode="json"), _status_line)


def run_resume(llm: ScalarLM, args: argparse.Namespace) -> None:
    _emit(args, llm.resume(args.job).model_dump(mode="json"), _status_line)


def run_delete(llm: ScalarLM, args: argparse.Namespace) -> None:
    _emit(args, llm.delete(args.job), lambda d: f"{args.job}: deleted")


def run_clear_queue(llm: ScalarLM, args: argparse.Namespace) -> None:
    _emit(args, llm.clear_queue(), lambda d: f"cleared {d.get('cleared', 0)} queued requests")


def _train_args(args: argparse.Namespace) -> dict[str, Any]:
    text = Path(args.train_args_file).read_text() if args.train_args_file else args.train_args
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"train args are not valid JSON: {e.msg}") from None
    if not isinstance(parsed, dict):
        raise ValueError("train args must be a JSON object")
    return parsed


def run_train(llm: ScalarLM, args: argparse.Namespace) -> int:
    job = llm.train(Path(args.data), model_name=args.model_name, train_args=_train_args(args))
    body: dict[str, Any] = {"job_id": job.id, "status": job["job_status"]["status"]}
    if args.wait:
        final = job.wait(timeout=args.timeout, progress=False if args.json else None)
        body.update(status=final.status, step=final.step, loss=final.loss)
    _emit(args, body, lambda d: f"{d['job_id']}: {d['status']}" + (f" step {d['step']} loss {cell(d['loss'])}"
                                                                      if "step" in d else ""))  # fmt: skip
    return 0


def run_export(llm: ScalarLM, args: argparse.Namespace) -> None:
    out = Path(args.output)
    from scalarlm.client.connection import resolve_api_key

    info = export_to_dir(llm, resolve_api_key(args.api_key), args.job, out, merged=args.merged, step=args.step)
    if args.push_to_hub:
        info["hub"] = push_to_hub(out, args.push_to_hub, args.hf_token)
    _emit(args, info, lambda d: f"{d['path']}: {d['kind']} weights of {args.job} step {d['step']}, "
                                f"{len(d['files'])} files" + (f"; pushed to {d['hub']}" if "hub" in d else ""))


@contextmanager
def download(api_url: str, api_key: str | None, path: str, dest: Path, params: dict[str, Any]) -> Iterator[Path]:
    """Stream a binary answer into `dest` (the client's URL and key); a non-2xx answer raises its typed error."""
    import httpx

    from scalarlm.client.connection import auth_headers, error_for

    timeout = httpx.Timeout(60.0, read=3600.0)  # a merge of a large model runs before the first byte
    with httpx.stream("GET", api_url + path, params=params, headers=auth_headers(api_key), timeout=timeout) as r:
        if not r.is_success:
            r.read()
            raise error_for(r)
        with dest.open("wb") as f:
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
    yield dest


def export_to_dir(llm: ScalarLM, api_key: str | None, job_id: str, dest: Path, merged: bool,
                  step: int | None) -> dict[str, Any]:  # fmt: skip
    """Stream the server's export tar into `dest` (created; files directly inside it)."""
    params: dict[str, Any] = {"merged": str(merged).lower()}
    if step is not None:
        params["step"] = step
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".export-") as scratch:
        with download(llm.api_url, api_key, f"/v1/megatron/train/{job_id}/export", Path(scratch) / "export.tar",
                      params) as path:
            with tarfile.open(path, mode="r:") as tar:
                tar.extractall(scratch, filter="data")
        (top,) = [p for p in Path(scratch).iterdir() if p.is_dir()]
        for f in top.iterdir():
            os.replace(f, dest / f.name)
    manifest = json.loads((dest / "export.json").read_text())
    return {"path": str(dest), "kind": manifest["kind"], "step": manifest["step"],
            "files": sorted(p.name for p in dest.iterdir() if p.is_file())}  # fmt: skip


def push_to_hub(folder: Path, repo_id: str, token: str | None) -> str:
    """Upload an export to a Hugging Face hub repo: only with a token and a reachable hub; refused clearly otherwise."""
    token = token or os.environ.get("HF_TOKEN")
    if not token:
        raise ValueError("--push-to-hub needs a token (--hf-token or $HF_TOKEN); the export stays in "
                         f"{folder}")  # fmt: skip
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ValueError(f"HF_HUB_OFFLINE is set: not pushing; the export stays in {folder}")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ValueError("--push-to-hub needs huggingface_hub: pip install huggingface_hub") from None
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, exist_ok=True, private=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    except Exception as e:  # the hub library raises many kinds (network, auth); each ends the command the same way
        raise ValueError(f"push to {repo_id} failed ({type(e).__name__}: {e}); the export stays in {folder}") from None
    return f"https://huggingface.co/{repo_id}"


# --- argument parsing and dispatch ----------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-url", help="server URL (default: SCALARLM_API_URL or http://localhost:8000)")
    p.add_argument("--api-key", help="API key sent as a Bearer token (default: SCALARLM_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's JSON (for scripts)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the operator subcommands on the `scalarlm` parser."""

    def command(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        _common(p)
        p.set_defaults(func=functools.partial(dispatch, fn))
        return p

    p = command("ls", run_ls, "training jobs and models with status, step, loss and version")
    p.add_argument("-A", "--all", action="store_true", help="every job and the base model (default: the newest 10)")
    command("models", run_models, "the models the server serves, with their current version")
    p = command("logs", run_logs, "a training job's logs")
    p.add_argument("job", metavar="JOB")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p = command("plot", run_plot, "plot a job's loss (and, for RL, reward) curve to an image")
    p.add_argument("job", metavar="JOB")
    p.add_argument("-o", "--output", metavar="FILE", help="image file (default: JOB.png; .pdf, .svg work too)")
    p.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average over N steps")
    command("squeue", run_squeue, "training jobs the launchers hold (queued or running)")
    command("stats", run_stats, "queue depth by state, throughput, workers and their engine load")
    for name, fn, text in (("cancel", run_cancel, "stop a training job (it saves its state)"),
                           ("resume", run_resume, "relaunch a FAILED or CANCELLED job from its saved state"),
                           ("delete", run_delete, "cancel a job if it runs and remove it")):  # fmt: skip
        command(name, fn, text).add_argument("job", metavar="JOB")
    command("clear-queue", run_clear_queue, "drop every queued, unfinished generate request")
    p = command("train", run_train, "start a training job on a JSONL dataset")
    p.add_argument("data", metavar="DATA.jsonl")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--train-args", metavar="JSON", help='train args as a JSON object, e.g. \'{"max_steps": 20}\'')
    group.add_argument("--train-args-file", metavar="FILE", help="train args from a JSON file")
    p.add_argument("--model-name", help="model to train from (default: the server's base model)")
    p.add_argument("--wait", action="store_true", help="wait until the job ends; exit 1 if it fails")
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    p = command("export", run_export, "write a trained model into a directory (merged full weights or the adapter)")
    p.add_argument("job", metavar="JOB")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write the model into")
    p.add_argument("--merged", action="store_true", help="merge a LoRA adapter into its base (full weights)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload to this Hugging Face repo (needs a token)")
    p.add_argument("--hf-token", help="Hugging Face token (default: $HF_TOKEN)")


def dispatch(fn: Command, args: argparse.Namespace) -> int:
    """Run one command; any failure is one line on stderr and exit status 1."""
    import httpx

    from scalarlm.client import ScalarLM, TrainingFailed
    from scalarlm.protocol.errors import ScalarLMError

    with ScalarLM(api_url=args.api_url, api_key=args.api_key) as llm:
        try:
            return fn(llm, args) or 0
        except TrainingFailed as e:
            return _fail(f"{e.job_id} FAILED: {e.reason or 'no reason recorded'}")
        except ScalarLMError as e:
            return _fail(f"{type(e).__name__}: {e.message}")
        except httpx.TransportError as e:
            return _fail(f"cannot reach {llm.api_url}: {e}")
        except (ValueError, OSError, TimeoutError, tarfile.TarError) as e:
            return _fail(str(e))


def _fail(message: str) -> int:
    print(f"scalarlm: {message}", file=sys.stderr)
    return 1

