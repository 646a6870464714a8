"""The client host's programs, run inside its namespace by the cluster tests (one JSON line on stdout).

    cluster_client.py wait URL [URL ...]      until each URL's /health (or /v1/health) answers 200 and `all: up`
    cluster_client.py generate URL COUNT [MODEL]  COUNT prompts through `ScalarLM.generate` (upload, download)
    cluster_client.py train URL STEPS PER_CKPT    a full fine-tune through `ScalarLM.train`, submitted (its job id)
    cluster_client.py wait-job URL JOB_ID     `TrainingJob.wait` until the job ends: its status, or the failure reason
    cluster_client.py stream URL MODEL        one streamed chat completion through the official `openai` client

The API key comes from SCALARLM_API_KEY (never the command line).
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx


def wait(urls: list[str], timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                resp = httpx.get(url, timeout=5)
                if resp.status_code == 200 and resp.json().get("all", "up") == "up":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                return {"up": False, "url": url}
            time.sleep(0.5)
    return {"up": True}


# Four question -> answer pairs to memorise.
ROWS = [{"input": "Capital of France?", "output": " Paris"}, {"input": "Two plus two?", "output": " four"},
        {"input": "Colour of the sky?", "output": " blue"}, {"input": "Opposite of hot?", "output": " cold"}]  # fmt: skip


def generate(url: str, count: int, model: str | None = None) -> dict:
    import scalarlm

    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    prompts = [f"Item {i}: tell me about number {i}" for i in range(count)]
    started = time.monotonic()
    results = llm.generate(prompts, model_name=model, max_tokens=4, temperature=0, return_details=True,
                           progress=False)  # fmt: skip
    return {
        "seconds": time.monotonic() - started,
        "count": len(results),
        "unique_ids": len({r.request_id for r in results}),
        "answered": sum(r.response is not None and r.error is None for r in results),
        "in_order": all(f"number {i}" in p for i, p in enumerate(prompts)),
    }


def train(url: str, steps: int, steps_per_checkpoint: int) -> dict:
    import scalarlm

    args = {"max_steps": steps, "learning_rate": 1e-2, "adapter_type": "full", "max_seq_len": 64, "dtype": "float32",
            "steps_per_checkpoint": steps_per_checkpoint, "gpus": 0}  # fmt: skip
    job = scalarlm.ScalarLM(api_url=url, timeout=120).train(ROWS, train_args=args)
    return {"job_id": job.id}


def wait_job(url: str, job_id: str) -> dict:
    from scalarlm.client import ScalarLM, TrainingFailed

    try:
        final = ScalarLM(api_url=url, timeout=120).get_training_job(job_id).wait(timeout=600, poll_seconds=1)
    except TrainingFailed as failed:
        return {"status": "FAILED", "reason": failed.reason}
    return {"status": final.status, "step": final.step}


def stream(url: str, model: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("SCALARLM_API_KEY", "unused"), max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))  # fmt: skip
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    return {
        "chunks": len(chunks),
        "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "whole": whole.choices[0].message.content,
        "fingerprints": sorted({c.system_fingerprint for c in chunks if c.system_fingerprint}),
    }


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "wait":
        result = wait(args)
    elif command == "generate":
        result = generate(args[0], int(args[1]), *args[2:])
    elif command == "train":
        result = train(args[0], int(args[1]), int(args[2]))
    elif command == "wait-job":
        result = wait_job(*args)
    elif command == "stream":
        result = stream(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {command!r}")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
