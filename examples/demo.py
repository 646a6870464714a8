"""scalarlm in a few minutes: start a server, send a batch through the client, one OpenAI chat, fine-tune, stop.

    .venv/bin/python examples/demo.py --model models/tiny      (what `make demo` runs)

Starts `scalarlm serve` (control plane + in-process vLLM worker) on a free loopback port with a
temporary home directory, waits until /v1/health says all=up, then shuts the server down with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import scalarlm
from train_demo import train_demo  # examples/train_demo.py (this script's directory is on sys.path)

HEALTH_TIMEOUT = 600.0


def free_port() -> int:
    """A loopback port nobody is listening on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, home: Path, port: int, log_path: Path) -> subprocess.Popen:
    """`scalarlm serve` as a child process, its output going to log_path."""
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--model", str(model), "--home", str(home),
               "--host", "127.0.0.1", "--port", str(port)]
    print("$", " ".join(command))
    log = log_path.open("wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_until_up(url: str, server: subprocess.Popen, log_path: Path) -> float:
    """Poll /v1/health until all=up; return the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < HEALTH_TIMEOUT:
        if server.poll() is not None:
            sys.exit(f"server exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=5).json().get("all") == "up":
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    sys.exit(f"server not up after {HEALTH_TIMEOUT:.0f} s:\n{log_path.read_text()[-4000:]}")


def stop_server(server: subprocess.Popen) -> int:
    """SIGTERM, then wait for a clean exit (kill only if it hangs)."""
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


def batch_demo(url: str, count: int, max_tokens: int) -> None:
    """Send `count` prompts through scalarlm.ScalarLM.generate and report throughput."""
    llm = scalarlm.ScalarLM(api_url=url)
    prompts = [f"What is {i} + {i + 1}?" for i in range(count - 1)]
    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
    start = time.monotonic()
    results = llm.generate([*prompts, conversation], max_tokens=max_tokens, return_details=True)
    seconds = time.monotonic() - start
    tokens = sum(r.completion_tokens or 0 for r in results)
    print(f"\nbatch: {len(results)} prompts, {tokens} tokens in {seconds:.2f} s "
          f"({len(results) / seconds:.1f} prompts/s, {tokens / seconds:.0f} tokens/s)")
    for prompt, result in list(zip([*prompts, "<chat: Hello!>"], results))[:3] + [("<chat: Hello!>", results[-1])]:
        print(f"  {prompt!r:32} -> {result.response!r}  [model={result.model} version={result.version} "
              f"finish={result.finish_reason}]")


def openai_demo(url: str) -> None:
    """One chat completion through the official openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("SCALARLM_API_KEY", "unused"))
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, temperature=0
    )
    print(f"\nopenai chat ({model}): {reply.choices[0].message.content!r} "
          f"[{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/tiny"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        from scalarlm.cli.tiny_model import make_tiny_model

        print(f"building a tiny random-weight model in {args.model}")
        make_tiny_model(args.model)

    with tempfile.TemporaryDirectory(prefix="scalarlm-demo-") as tmp:
        home, port = Path(tmp) / "home", free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        server = start_server(args.model.resolve(), home, port, log_path)
        try:
            print(f"server up in {wait_until_up(url, server, log_path):.1f} s at {url} (log: {log_path})")
            print("health:", scalarlm.ScalarLM(api_url=url).health())
            batch_demo(url, args.prompts, args.max_tokens)
            openai_demo(url)
            train_demo(url, args.model, Path("build/demo"))
        finally:
            code = stop_server(server)
            # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is a clean stop.
            clean = code in (0, -signal.SIGTERM)
            print(f"\nserver stopped {'cleanly' if clean else f'with exit code {code}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
