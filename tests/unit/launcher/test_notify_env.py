"""What a trainer is told about the control plane: the notify URL (this server's bound port, or a split-mode
api_url for a SLURM node) and the internal notify key, which travels in the environment only, never in argv, the
launch record or the sbatch script."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher, SlurmLauncher, read_record
from scalarlm.launcher.base import notify_key, notify_url

# Writes what it was given (URL, key) to a file next to the job, like the trainer would use them.
ENV_REPORTER = """
    import os, sys, pathlib
    out = pathlib.Path(sys.argv[1]) / "env-seen.txt"
    out.write_text(os.environ.get("SCALARLM_NOTIFY_URL", "-") + "\\n" + os.environ.get("SCALARLM_NOTIFY_KEY", "-"))
"""

# A stand-in `sbatch` on PATH: records its argv, the notify variables of its environment and the script it got.
SBATCH_RECORDER = """\
#!/bin/sh
out="$SBATCH_RECORD"
printf '%s\\n' "$@" > "$out.argv"
printf '%s\\n%s\\n' "${SCALARLM_NOTIFY_URL:--}" "${SCALARLM_NOTIFY_KEY:--}" > "$out.env"
echo 4242
"""


def with_server(tmp_path: Path, **server: object) -> Settings:
    return Settings(home=tmp_path / "home", model=str(tmp_path / "model"), server=server)


def test_notify_url_is_this_servers_bound_port_whatever_the_role(tmp_path: Path) -> None:
    # The old bug: role api used the default api_url (port 8000) although the server listened elsewhere.
    api = with_server(tmp_path, role="api", port=9123)
    assert notify_url(api) == "http://127.0.0.1:9123"
    assert notify_url(with_server(tmp_path, host="0.0.0.0", port=9124)) == "http://127.0.0.1:9124"
    assert notify_url(with_server(tmp_path, host="::1", port=9125)) == "http://[::1]:9125"
    assert notify_url(with_server(tmp_path, port=0)) is None  # unknown port: the file poll finds the steps


def test_remote_trainers_use_a_configured_api_url_or_this_host(tmp_path: Path) -> None:
    split = with_server(tmp_path, role="api", port=9000, api_url="http://scalarlm-api:8000/")
    assert notify_url(split, remote=True) == "http://scalarlm-api:8000"
    assert notify_url(split) == "http://127.0.0.1:9000"  # a local trainer talks to the listener itself
    default_api_url = with_server(tmp_path, role="api", host="0.0.0.0", port=9001)
    assert notify_url(default_api_url, remote=True) == f"http://{os.uname().nodename}:9001"


def test_notify_key_is_private_created_once_and_reused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    key = notify_key(home)
    path = home / "internal" / "notify.key"
    assert len(key) >= 40 and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert notify_key(home) == key  # a restarted control plane keeps it: running trainers still authenticate
    assert notify_key(tmp_path / "other-home") != key


def test_local_trainer_gets_url_and_key_in_its_environment_only(tmp_path: Path, new_job, wait_for) -> None:
    settings = with_server(tmp_path, role="api", port=9555)
    reporter = tmp_path / "env_reporter.py"
    reporter.write_text(textwrap.dedent(ENV_REPORTER))
    job, config = new_job()
    launcher = LocalLauncher(settings, entry=[str(reporter)])
    os.environ["SCALARLM_NOTIFY_KEY"] = "inherited-key"  # the control plane's own env never leaks through
    try:
        launcher.submit(job, config)
    finally:
        del os.environ["SCALARLM_NOTIFY_KEY"]
    seen = job.root / "env-seen.txt"
    assert wait_for(seen.exists)
    key = notify_key(settings.home)
    assert seen.read_text().split("\n") == ["http://127.0.0.1:9555", key]
    assert key not in " ".join(read_record(job).command)

    cmd = LocalLauncher(settings).command(*new_job(cpu_ranks=2))  # mpirun: -x passes names, not values
    assert cmd[cmd.index("SCALARLM_NOTIFY_KEY") - 1] == "-x" and key not in " ".join(cmd)


def test_slurm_passes_url_and_key_through_sbatchs_environment_not_the_script(tmp_path: Path, new_job) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(SBATCH_RECORDER)
    sbatch.chmod(0o755)
    settings = with_server(tmp_path, role="api", port=9556, api_url="http://scalarlm-api:8000")
    job, config = new_job()
    record = tmp_path / "sbatch-call"
    old_path = os.environ["PATH"]
    os.environ.update(PATH=f"{bin_dir}:{old_path}", SBATCH_RECORD=str(record))
    try:
        assert SlurmLauncher(settings, launch="mpirun").submit(job, config) == "4242"
    finally:
        os.environ["PATH"] = old_path
        del os.environ["SBATCH_RECORD"]
    key = notify_key(settings.home)
    assert record.with_suffix(".env").read_text().split("\n")[:2] == ["http://scalarlm-api:8000", key]
    argv = record.with_suffix(".argv").read_text().split("\n")
    assert "--export=ALL" in argv and key not in " ".join(argv)
    script = (job.root / "sbatch.sh").read_text()
    assert key not in script
    assert "-x SCALARLM_NOTIFY_URL -x SCALARLM_NOTIFY_KEY" in script  # mpirun hands both to every rank
    assert "the key is deliberately not in this file" in script
    assert sys.executable in script


def test_a_trainer_on_an_embedded_node_is_told_where_to_stage_full_weights(tmp_path: Path) -> None:
    """`training.staging_dir`: one root per home under it, on an embedded node only; "" (or a missing directory)
    turns staging off, as does a split deployment (the engine is elsewhere and could not read it)."""
    from scalarlm.checkpoint.staging import STAGING_ENV, staging_root

    shm = tmp_path / "shm"
    shm.mkdir()

    def staging(role: str, staging_dir: str) -> str | None:
        settings = Settings(home=tmp_path / "home", model=str(tmp_path / "model"), server={"role": role},
                            training={"staging_dir": staging_dir})  # fmt: skip
        return LocalLauncher(settings)._environment().get(STAGING_ENV)

    assert staging("embedded", str(shm)) == str(staging_root(str(shm), tmp_path / "home"))
    assert Path(staging("embedded", str(shm))).parent == shm
    assert staging("embedded", "") is None
    assert staging("embedded", str(tmp_path / "absent")) is None
    assert staging("api", str(shm)) is None
