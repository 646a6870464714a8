"""Which published steps may be left out of the durable landings (`Trainer.publish`'s rule), through the real staging
publisher: a step published to serve (a session step, a `steps_per_publish` step) unless it is a `steps_per_checkpoint`
step. The model's export is stood in by a writer of a few bytes: what is under test is which steps land."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scalarlm.checkpoint import JobDir, list_steps
from scalarlm.checkpoint.staging import StagedPublisher
from scalarlm.protocol.training import TrainArgs
from scalarlm.training import loop
from scalarlm.training.loop import Trainer


def test_serving_steps_are_supersedable_except_checkpoint_steps_and_other_publishes_always_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: Any
) -> None:
    def export(job, model, arch, par, base, base_config, manifest, dtype, publish):  # publish_checkpoint's arguments
        publish(job, manifest, lambda d: (d / "model.safetensors").write_bytes(b"w%d" % manifest.step))

    monkeypatch.setattr(loop, "publish_checkpoint", export)
    job = JobDir.under(tmp_path / "jobs", "j")
    job.create()
    trainer = SimpleNamespace(
        config=SimpleNamespace(job_id="j", base_model="base"), args=TrainArgs(
            steps_per_checkpoint=3, adapter_type="full", publish_dtype="source", max_checkpoints_to_keep=None),
        job=job, lora=False, bf16=False, par=SimpleNamespace(is_main=False), publisher=StagedPublisher(
            job, tmp_path / "shm", held), model=None, arch=None, base=None, base_config={}, published=0, step=0,
    )  # fmt: skip
    publishes = [(1, True), (2, True), (3, True), (4, True), (5, False), (6, True), (7, True), (8, True)]
    for step, serving in publishes:
        trainer.step = step
        Trainer.publish(trainer, None, serving=serving)
        if step == 1:
            held.wait_for_first()
    held.release.set()
    trainer.publisher.wait()
    # 1: landing when the rest were published; 3 and 6: checkpoint steps; 5: not a serving publish (e.g. a Tinker
    # save_weights_for_sampler); 8: the newest. 2, 4 and 7 were overtaken before their landing began.
    assert held.landed == [1, 3, 5, 6, 8] and list_steps(job) == [1, 3, 5, 6, 8]
