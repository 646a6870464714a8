"""Mixture-of-experts benchmark: SFT tokens/s of a small Qwen3-MoE at expert parallelism 2 ÷ EP=1, same global batch.

The model: Qwen3-MoE shaped (every layer sparse, 8 experts, top 2, renormalised), hidden 512, 6 layers, each expert's
intermediate size 512, vocab 1024. Both sides run two ranks under mpirun on the rows and settings of
`bench.training` (sequence length 128, 8 sequences per step, fp32, full weights): EP=1 is plain data parallelism
(every rank holds all 8 experts and its grads are summed over the ranks); EP=2 splits the experts, 4 per rank, the
allgather dispatcher carrying each rank's tokens to the other's experts and back. `moe_ep2_speedup` = EP=2 ÷ EP=1;
`moe_ep2_vs_one_rank` compares EP=2 with one rank using every core. Throughput: real tokens of steps 2..N over their
wall time (`bench.training.steady_rate`). Not a test: the ratios are measured in this one run, load printed beside.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, drop_weights, merge_results
from bench.training import best_run, line, load, ours

SHAPE = dict(layers=6, hidden=512, heads=8, kv_heads=4, vocab=1024, seed=0,
             config_overrides={"num_experts": 8, "moe_intermediate_size": 512})  # fmt: skip


def make_moe_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        from scalarlm.cli.tiny_model import make_tiny_model

        make_tiny_model(path, family="qwen3_moe", **SHAPE)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs per side; each side's best is kept")
    args = ap.parse_args()
    model = make_moe_model(ROOT / "build" / "bench" / "model-qwen3-moe")
    work = Path(tempfile.mkdtemp(prefix="bench-moe-", dir=ROOT / "build" / "bench"))
    print(f"model {model} ({SHAPE}), {args.steps} steps; work {work}")
    before = load()
    runs: dict[str, list[dict]] = {"one": [], "ep1": [], "ep2": []}
    for r in range(args.repeat):
        runs["ep1"].append(ours(model, args.steps, work, 2, None, f"moe-ep1-{r}"))
        runs["ep2"].append(ours(model, args.steps, work, 2, None, f"moe-ep2-{r}", expert_parallel_size=2))
        runs["one"].append(ours(model, args.steps, work, 1, None, f"moe-1rank-{r}"))
    one, ep1, ep2 = (best_run(runs[k]) for k in ("one", "ep1", "ep2"))
    figures = {"moe_ep2_speedup": round(ep2["tokens_per_second"] / ep1["tokens_per_second"], 3),
               "moe_ep2_vs_one_rank": round(ep2["tokens_per_second"] / one["tokens_per_second"], 3)}  # fmt: skip
    print(line("Qwen3-MoE, 1 rank", one))
    print(line("Qwen3-MoE, 2 ranks, EP=1 (DP=2)", ep1))
    print(line("Qwen3-MoE, 2 ranks, EP=2", ep2))
    print(f"moe_ep2_speedup = {figures['moe_ep2_speedup']} (EP=2 / EP=1, same 2 ranks and global batch); "
          f"EP=2 / one rank = {figures['moe_ep2_vs_one_rank']}   load avg {before} -> {load()}")  # fmt: skip
    merge_results(figures)
    print(json.dumps(figures))
    drop_weights(work)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
