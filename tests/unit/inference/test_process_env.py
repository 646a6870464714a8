"""The OpenMP setting `scalarlm serve` makes before torch loads."""

import os
import subprocess
import sys

import pytest

from scalarlm.inference.process_env import OPENMP_SPIN_COUNT, configure_openmp_env


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


def test_the_spin_count_is_set_when_the_user_set_none(clean_env):
    configure_openmp_env()
    assert os.environ["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT


def test_a_users_spin_count_or_wait_policy_wins(clean_env):
    clean_env.setenv("GOMP_SPINCOUNT", "200000")
    configure_openmp_env()
    assert os.environ["GOMP_SPINCOUNT"] == "200000"
    clean_env.delenv("GOMP_SPINCOUNT")
    clean_env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    configure_openmp_env()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_scalarlm_serve_sets_it_before_it_builds_anything(tmp_path):
    """`scalarlm serve` (its `serve()` replaced, so nothing starts) has the setting in place, torch not loaded."""
    code = (
        "import os, sys, types\n"
        "fake = types.ModuleType('scalarlm.cli.serve')\n"
        "fake.serve = lambda settings: print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules) or 0\n"
        "sys.modules['scalarlm.cli.serve'] = fake\n"
        "from scalarlm.cli.main import main\n"
        f"sys.exit(main(['serve', '--home', {str(tmp_path)!r}]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [OPENMP_SPIN_COUNT, "False"]
