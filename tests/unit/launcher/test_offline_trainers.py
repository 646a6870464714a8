"""Trainers run with the Hugging Face hub offline: they get a resolved local directory, so a hub call is a fast
error, never a download that hangs (a real subprocess reports the environment it got)."""

from __future__ import annotations

import json
import textwrap

from scalarlm.launcher import LocalLauncher, SlurmLauncher


def test_local_trainers_run_offline(settings, new_job, wait_for, tmp_path) -> None:
    script = tmp_path / "env_trainer.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, pathlib
        (pathlib.Path(sys.argv[1]) / "env.json").write_text(json.dumps({"offline": os.environ.get("HF_HUB_OFFLINE")}))
    """))
    launcher = LocalLauncher(settings, entry=[str(script)])
    job, config = new_job()
    launcher.submit(job, config)
    assert wait_for(lambda: (job.root / "env.json").exists())
    assert json.loads((job.root / "env.json").read_text()) == {"offline": "1"}


def test_slurm_ranks_run_offline(settings) -> None:
    assert SlurmLauncher(settings).sbatch_environment()["HF_HUB_OFFLINE"] == "1"
