"""Fine-tune the served base model on a small built-in question -> answer set, then check it learned them.

    .venv/bin/python examples/train_demo.py --url http://127.0.0.1:8000 --model models/tiny

`make demo` runs this against its own server (examples/demo.py). The job goes through the client
(`ScalarLM.train`), trains with the real trainer under the local launcher, and publishes an HF-format
checkpoint; the demo then loads that checkpoint with plain `transformers`, greedily answers every
training question, and writes the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import scalarlm

# Short answers a tiny random model can memorise in a few dozen steps on two CPU cores.
QA = [
    {"input": "What is the capital of France?", "output": " Paris"},
    {"input": "What colour is the sky?", "output": " blue"},
    {"input": "What is two plus two?", "output": " four"},
    {"input": "What is the opposite of hot?", "output": " cold"},
    {"input": "How many legs does a spider have?", "output": " eight"},
    {"input": "What do bees make?", "output": " honey"},
]
TRAIN_ARGS = {"max_steps": 40, "learning_rate": 1e-2, "adapter_type": "full", "steps_per_checkpoint": 40,
              "max_seq_len": 64, "dtype": "float32"}  # fmt: skip


def check_answers(checkpoint: Path, base_model: Path) -> int:
    """Greedy answers from the published checkpoint, loaded with plain transformers; return how many match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    right = 0
    for row in QA:
        prompt = tokenizer(row["input"], return_tensors="pt")
        expected = tokenizer(row["output"], add_special_tokens=False)["input_ids"]
        out = model.generate(**prompt, max_new_tokens=len(expected), do_sample=False)
        got = out[0, prompt["input_ids"].shape[1] :].tolist()
        right += got == expected
        print(f"  {row['input']!r:40} -> {tokenizer.decode(got)!r:10} {'ok' if got == expected else 'MISS'}")
    return right


def train_demo(url: str, base_model: Path, out_dir: Path) -> Path:
    """Train through the client, wait with a progress bar, check the answers; return the loss-curve PNG path."""
    llm = scalarlm.ScalarLM(api_url=url)
    start = time.monotonic()
    job = llm.train(QA, train_args=TRAIN_ARGS)
    print(f"\ntraining job {job.id} submitted ({len(QA)} question -> answer rows, {TRAIN_ARGS['max_steps']} steps)")
    final = job.wait(timeout=1800, progress=True)
    metrics = job.metrics()
    print(f"training {final.status} in {time.monotonic() - start:.1f} s: "
          f"loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.4f}")  # fmt: skip
    info = job.info()
    checkpoint = Path(info.job_status["job_directory"]) / "checkpoints" / f"step-{info.checkpoints[-1]}"
    print(f"checkpoint {checkpoint} (opens with transformers.AutoModelForCausalLM.from_pretrained):")
    right = check_answers(checkpoint, base_model)
    print(f"  {right}/{len(QA)} training answers reproduced")
    png = llm.plot(job, out_dir / "loss.png")
    print(f"loss curve: {png.resolve()}")
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", type=Path, default=Path("models/tiny"), help="the server's base model directory")
    parser.add_argument("--out", type=Path, default=Path("build/demo"))
    args = parser.parse_args()
    train_demo(args.url, args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
