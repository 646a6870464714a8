"""`make bench`: run every benchmark; each prints its figures and merges them into build/bench/results.json."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = [
    ["bench.serving"],
    ["bench.training"],
    ["bench.training", "--family", "qwen3"],  # sft_vs_hf_trainer_qwen3, beside the Llama figure
    ["bench.grpo"],
    ["bench.grpo_learn"],  # 30 steps of a learnable task x 3 seeds, sync, async and TRL, the reward curves in one PNG
    ["bench.tinker_step"],  # Tinker forward_backward, packed with shared prompts vs one datum per forward
    ["bench.moe"],  # Qwen3-MoE SFT at EP=2 vs EP=1
    ["bench.publish_latency"],
    ["bench.scale_out"],  # split cluster with a worker killed (needs root for namespaces), 1M upload, 1k streams
]

if __name__ == "__main__":
    failed = [s for s in SUITES if subprocess.run([sys.executable, "-m", *s, *sys.argv[1:]], cwd=ROOT).returncode]
    sys.exit(1 if failed else 0)
