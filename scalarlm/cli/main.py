"""The `scalarlm` console entry: parse arguments, load settings once, dispatch to a subcommand."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from scalarlm.cli.ops import add_commands
from scalarlm.cli.tiny_model import FAMILIES

logger = logging.getLogger(__name__)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the control plane, a worker, or both in one process (default)")
    p.add_argument("--model", help="base model: a local Hugging Face directory")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; a worker's default is 8001)")
    p.add_argument("--home", help="shared directory for the queue, jobs and checkpoints")
    p.add_argument("--config", help="YAML settings file")
    p.add_argument("--role", choices=["embedded", "api", "worker"], help="what this process runs")
    p.add_argument("--api-url", help="worker role: where the control plane is")
    p.add_argument("--worker-url", action="append", help="api role: a worker's URL (repeatable)")
    p.add_argument(
        "--allow-insecure-public", action="store_true", default=None,
        help="allow a non-loopback host without API keys",
    )
    p.set_defaults(func=_run_serve)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="send prompts to a running server and print the completions")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model-name", help="model to use (default: the server's base model)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate per prompt")
    p.add_argument("--api-url", help="server URL (default: SCALARLM_API_URL or http://localhost:8000)")
    p.add_argument("--api-key", help="API key sent as a Bearer token (default: SCALARLM_API_KEY)")
    p.set_defaults(func=_run_generate)


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a tiny random-weight model for tests and demos")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default="llama", help="model family (its real config fields)")
    p.add_argument("--tie-embeddings", action="store_true", default=None,
                   help="tie the output layer to the embedding (default: as the family's real checkpoints do)")
    p.set_defaults(func=_run_make_tiny_model)


def _add_dequantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dequantize", help="rewrite an MXFP4 (gpt-oss) or fine-grained FP8 (DeepSeek-V3, Qwen3-FP8) "
                                          "checkpoint in bf16 to train and serve")  # fmt: skip
    p.add_argument("src", metavar="DIR", help="the quantized checkpoint (a local Hugging Face directory)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the bf16 checkpoint")
    p.set_defaults(func=_run_dequantize)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="scalarlm", description="scalarlm: train and serve LLMs on one cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_make_tiny_model(sub)
    _add_dequantize(sub)
    add_commands(sub)
    return parser


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Settings overrides (nested shape) from the `serve` flags that were given."""
    server: dict[str, Any] = {}
    # A split-mode worker listens on server.worker_port; `--role worker --port N` means that port.
    port_key = "worker_port" if args.role == "worker" else "port"
    for flag, key in (("host", "host"), ("port", port_key), ("role", "role"), ("api_url", "api_url"),
                      ("worker_url", "worker_urls"), ("allow_insecure_public", "allow_insecure_public")):
        value = getattr(args, flag)
        if value is not None:
            server[key] = value
    overrides: dict[str, Any] = {}
    if server:
        overrides["server"] = server
    if args.model is not None:
        overrides["model"] = args.model
    if args.home is not None:
        overrides["home"] = args.home
    return overrides


def _run_serve(args: argparse.Namespace) -> int:
    from scalarlm.inference.process_env import configure_openmp_env

    configure_openmp_env()  # before torch loads
    from scalarlm.cli.serve import serve
    from scalarlm.config import load_settings

    settings = load_settings(args.config, **serve_overrides(args))
    return serve(settings)


def _run_generate(args: argparse.Namespace) -> int:
    import httpx

    from scalarlm.client import ScalarLM
    from scalarlm.protocol.errors import ScalarLMError

    with ScalarLM(api_url=args.api_url, api_key=args.api_key) as llm:
        try:
            results = llm.generate(args.prompts, model_name=args.model_name, max_tokens=args.max_tokens)
        except httpx.TransportError as exc:
            print(f"scalarlm: cannot reach {llm.api_url}: {exc}", file=sys.stderr)
            return 1
        except ScalarLMError as exc:
            print(f"scalarlm: {type(exc).__name__}: {exc.message}", file=sys.stderr)
            return 1
    for result in results:
        print(result)
    return 0


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from scalarlm.cli.tiny_model import make_tiny_model

    path = make_tiny_model(
        args.dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seed=args.seed,
        heads=args.heads, kv_heads=args.kv_heads, family=args.family, tie_embeddings=args.tie_embeddings,
    )
    print(path)
    return 0


def _run_dequantize(args: argparse.Namespace) -> int:
    from scalarlm.training.dequantize import dequantize_checkpoint

    try:
        method, decoded = dequantize_checkpoint(args.src, args.output)
    except ValueError as e:
        print(f"scalarlm dequantize: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(decoded)} {method.upper()} tensors decoded to bfloat16")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `scalarlm` subcommand and return its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One INFO line per HTTP request would bury the output of `scalarlm generate`.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
