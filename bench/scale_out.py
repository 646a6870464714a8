"""Scale-out benchmark (issue 15): a split cluster losing a worker, a million prompts in one upload, and a thousand
streaming OpenAI clients, each against a baseline measured in the same run.

- `split_*`: API + two workers + a client on four hosts (network namespaces, needs root), started through the CLI
  as the cluster tests start them (tests/integration/cluster: the same helpers). N prompts through
  `ScalarLM.generate` once undisturbed, then once with one worker SIGKILLed at 30% done: prompts lost, prompts
  answered twice, and the drain time of the killed run / the undisturbed one.
- `submit_1m_*`: one `POST /v1/generate/upload` of 1,000,000 prompts (the SDK's path for big batches) to an
  embedded `scalarlm serve`: accept seconds, control-plane RSS growth, prompts not stored.
- `openai_1k_*`: 1,000 concurrent streaming `/v1/completions` clients against `scalarlm serve` and against
  `vllm serve` with the same engine flags: completion chunks/s ratio, p99 time-to-first-token ratio, and our 5xx
  count (a 429 is retried after its Retry-After, its wait counted in that request's TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, free_port, merge_results, rss_mb
from bench.serving import serve, vllm_serve

CLUSTER_HELPERS = ROOT / "tests" / "integration" / "cluster"


def split_kill(model: Path, n: int) -> dict:
    """Lost, duplicated and the kill's slowdown for `n` prompts through two namespaced workers."""
    sys.path.insert(0, str(CLUSTER_HELPERS))
    from cluster_roles import result_of, running_cluster
    from netns_hosts import netns_available

    reason = netns_available()
    if reason is not None:
        print(f"split cluster: skipped ({reason})")
        return {}
    with tempfile.TemporaryDirectory() as tmp, running_cluster(model, Path(tmp)) as cluster:
        cluster.client("generate", cluster.api_url, "500")  # warm-up: both engines see every batch shape
        calm = cluster.client("generate", cluster.api_url, str(n))
        before = cluster.completed()
        client = cluster.client("generate", cluster.api_url, str(n), background=True)
        cluster.wait_completed(before + int(0.3 * n), timeout=900)
        cluster.kill("w1")
        killed = result_of(client)
    figures = {"split_lost": n - killed["answered"], "split_duplicated": killed["count"] - killed["unique_ids"],
               "split_kill_slowdown": round(killed["seconds"] / calm["seconds"], 3)}  # fmt: skip
    print(f"split cluster, {n} prompts: undisturbed {calm['seconds']:.1f} s, one worker SIGKILLed at 30% "
          f"{killed['seconds']:.1f} s (x{figures['split_kill_slowdown']}); lost {figures['split_lost']}, "
          f"duplicated {figures['split_duplicated']} (targets 0, 0)")
    return figures


def submit_upload(url: str, pid: int, n: int) -> dict:
    """One upload of `n` prompts: accept seconds, server RSS growth (MB), prompts not stored."""
    from scalarlm.client.payloads import upload_rows

    body = upload_rows([f"p{i}" for i in range(n)], None, {"max_tokens": 1})
    before = rss_mb(pid)
    start = time.perf_counter()
    answer = httpx.post(f"{url}/v1/generate/upload", files={"file": ("requests.json", body, "application/json")},
                        timeout=900)  # fmt: skip
    accept = time.perf_counter() - start
    answer.raise_for_status()
    grew = rss_mb(pid) - before
    stored = sum(httpx.get(f"{url}/v1/generate/metrics", timeout=120).json()["queue"].values())
    httpx.post(f"{url}/v1/generate/clear_queue", timeout=600)
    total = answer.json()["total_requests"]
    figures = {"submit_1m_seconds": round(accept, 3), "submit_1m_rss_mb": round(grew, 1),
               "submit_1m_lost": n - min(stored, total)}  # fmt: skip
    print(f"{n} prompts in one upload: accepted in {accept:.1f} s (target <= 30), RSS +{grew:.0f} MB "
          f"(target <= 300), lost {figures['submit_1m_lost']} (target 0)")
    return figures


async def streaming_clients(url: str, model: str, clients: int, max_tokens: int) -> dict:
    """`clients` concurrent streamed completions: chunks/s, p99 TTFT (s), 5xx answers."""
    ttft: list[float] = []
    chunks = errors = 0
    limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal chunks, errors
            body = {"model": model, "prompt": f"Question {i}: what is {i % 97} plus {i % 13}? Answer:",
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
            start = time.perf_counter()
            while True:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
                    if answer.status_code == 429:
                        await answer.aread()
                        await asyncio.sleep(float(answer.headers.get("retry-after", "0.5")))
                        continue
                    if answer.status_code >= 500:
                        errors += 1
                        return
                    answer.raise_for_status()
                    first = True
                    async for line in answer.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if first:
                            ttft.append(time.perf_counter() - start)
                            first = False
                        chunks += 1
                    return

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        seconds = time.perf_counter() - start
    ttft.sort()
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan")
    return {"chunks_per_second": chunks / seconds, "p99_ttft": p99, "errors_5xx": errors, "answered": len(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    ap.add_argument("--split-prompts", type=int, default=20_000)
    ap.add_argument("--upload-prompts", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=1_000)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    model = Path(args.model).resolve()
    logs = ROOT / "build" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    figures = split_kill(model, args.split_prompts)

    port = free_port()
    with tempfile.TemporaryDirectory() as home, serve(str(model), home, port, logs / "scale-out-serve.log") as srv:
        url = f"http://127.0.0.1:{port}"
        figures.update(submit_upload(url, srv.pid, args.upload_prompts))
        asyncio.run(streaming_clients(url, model.name, 64, args.max_tokens))  # warm-up
        ours = asyncio.run(streaming_clients(url, model.name, args.clients, args.max_tokens))
    port = free_port()
    with vllm_serve(str(model), port, logs / "scale-out-vllm-serve.log"):
        url = f"http://127.0.0.1:{port}"
        asyncio.run(streaming_clients(url, model.name, 64, args.max_tokens))
        theirs = asyncio.run(streaming_clients(url, model.name, args.clients, args.max_tokens))
    figures["openai_1k_vs_vllm_serve"] = round(ours["chunks_per_second"] / theirs["chunks_per_second"], 3)
    figures["openai_1k_p99_ttft_ratio"] = round(ours["p99_ttft"] / theirs["p99_ttft"], 3)
    figures["openai_1k_5xx"] = ours["errors_5xx"]
    print(f"{args.clients} streaming clients: ours {ours['chunks_per_second']:.0f} chunks/s, p99 TTFT "
          f"{ours['p99_ttft']:.2f} s, {ours['errors_5xx']} 5xx, {ours['answered']} answered; vllm serve "
          f"{theirs['chunks_per_second']:.0f} chunks/s, p99 TTFT {theirs['p99_ttft']:.2f} s, "
          f"{theirs['errors_5xx']} 5xx -> ratio {figures['openai_1k_vs_vllm_serve']} (target >= 1.0), "
          f"p99 TTFT ratio {figures['openai_1k_p99_ttft_ratio']} (target <= 1.1)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    merge_results(figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
