"""Run by test_moe_parity.py (one process): `replay_reference_check.py JOB_DIR`. Runs the job's trainer in this
process, recording every KL reference the GRPO loss computes (`rl_step._reference_logp`, one per micro-batch), and
prints `RESULT {"status", "steps", "max_pass_diff"}`: the largest difference between a batch's references on its later
passes and on its first. The reference is the frozen base, so with a fixed batch it must not change between passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch

    from scalarlm.checkpoint import JobDir
    from scalarlm.training import rl_step
    from scalarlm.training.__main__ import main as train

    job = JobDir(Path(sys.argv[1]))
    passes = job.read_config().train_args.num_iterations
    seen: dict[int, list[torch.Tensor]] = {}  # step -> the references of its micro-batches, in order
    reference = rl_step._reference_logp

    def recorded(trainer, batch):
        out = reference(trainer, batch)
        seen.setdefault(trainer.step + 1, []).append(out[batch.loss_mask.to(out.device) > 0].detach().clone())
        return out

    rl_step._reference_logp = recorded
    rc = train([str(job.root)])
    diffs = [float((a - b).abs().max()) for step, refs in seen.items() if (step - 1) % passes
             for a, b in zip(refs, seen[step - (step - 1) % passes])]  # fmt: skip
    print("RESULT " + json.dumps({"rc": rc, "status": job.read_status().status, "steps": sorted(seen),
                                  "compared": len(diffs), "max_pass_diff": max(diffs, default=None)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
