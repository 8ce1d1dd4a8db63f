"""The local Slurm cluster (scripts/slurm-local) for tests: brought up once per session, taken down after.

A cluster that is already up ($FEDTUNE_SLURM_DIR, the default .slurm-local/, or the tests' own folder,
say from another test session) is used as it is and left running; otherwise the tests start their own in
$FEDTUNE_TEST_TMP/slurm-local (kept between sessions, so only the first start initialises MariaDB) and
stop it at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM_LOCAL = ROOT / "scripts" / "slurm-local"
VENV_BIN = str(Path(sys.executable).parent)
PACKAGE_COMMANDS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any SLURM_* variable (a test may itself run inside a job), with the
    venv first on PATH, so jobs that inherit it (sbatch --export=ALL) find python and snakemake."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def slurm_local(command: str, state: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = clean_env(FEDTUNE_SLURM_DIR=str(state))
    return subprocess.run(
        [str(SLURM_LOCAL), command], env=env, capture_output=True, text=True, timeout=timeout
    )


@dataclass
class Cluster:
    state: Path
    started: bool  # True when this session started it (and so stops it)

    @property
    def conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(SLURM_CONF=str(self.conf), **extra)

    def run(self, *command: str, timeout: int = 120, check: bool = True, cwd=None):
        result = subprocess.run(
            list(command), env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def submit(self, *sbatch_args: str, cwd: Path, timeout: int = 60) -> list[dict[str, str]]:
        """sbatch a job and wait until sacct reports it finished; returns sacct's row."""
        name = "fedtune-test"
        command = ["sbatch", "--parsable", "--job-name", name, *sbatch_args]
        job_id = self.run(*command, cwd=cwd).stdout.strip().split(";")[0]
        return self.wait_for_states([job_id], name=name, timeout=timeout)

    def jobs(self, workdir: Path | None = None, job_ids=None) -> list[dict[str, str]]:
        """sacct's view of the jobs (allocations only, no steps) started in workdir, or with job_ids."""
        fields = ["JobID", "JobName", "State", "ExitCode", "NodeList", "WorkDir", "Comment", "AllocTRES"]
        command = ["sacct", "-X", "-n", "-P", "-S", "now-6hours", "-o", ",".join(fields)]
        if job_ids:
            command += ["-j", ",".join(map(str, job_ids))]
        rows = [
            dict(zip(fields, line.split("|"), strict=True)) for line in self.run(*command).stdout.splitlines()
        ]
        if workdir is not None:
            rows = [row for row in rows if row["WorkDir"] == str(workdir)]
        return rows

    def job_record(self, job_id: str) -> dict[str, str]:
        """The controller's record of a job (`scontrol show job`), kept MinJobAge (300 s) after it ends:
        how Slurm holds the request (NumTasks, NtasksPerN:B:S:C, TresPerNode, NtasksPerTRES, ...)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def wait_for_states(self, job_ids, name=None, timeout=60):
        """Poll sacct until every job has reached a final state with its whole record. Accounting trails
        the job: when a short job's end reaches slurmdbd before its start, sacct shows for a while a
        placeholder record (name "allocation", part of the node list), so with `name` the record also
        has to carry the job's name."""
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")
        deadline = time.monotonic() + timeout
        while True:
            rows = self.jobs(job_ids=job_ids)
            done = [row for row in rows if row["State"].split()[0] in final]
            if len(done) == len(job_ids) and all(name is None or row["JobName"] == name for row in rows):
                return rows
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs {job_ids} not finished after {timeout}s: {rows}")
            time.sleep(0.5)


def start_cluster() -> Cluster:
    """Bring the local cluster up for the tests, or skip (with the reason) when that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (its daemons run as SlurmUser=root)")
    test_state = Path(os.environ.get("FEDTUNE_TEST_TMP", "/tmp/fedtune-tests")) / "slurm-local"
    # The cluster that /etc/slurm/slurm.conf points at (scripts/slurm-local links it) may be another
    # worktree's: one machine holds one local cluster, whichever folder its state is in.
    linked = Path("/etc/slurm/slurm.conf")
    running = linked.resolve().parent.parent if linked.is_symlink() else None
    candidates = [os.environ.get("FEDTUNE_SLURM_DIR"), ROOT / ".slurm-local", running, test_state]
    for candidate in filter(None, candidates):
        # Already up (a user's cluster, or another test session's): use it, leave it running.
        if Path(candidate).is_dir() and slurm_local("status", Path(candidate), timeout=60).returncode == 0:
            return Cluster(Path(candidate), started=False)
    state = test_state
    result = slurm_local("up", state)
    if result.returncode != 0:
        missing = [
            c for c in PACKAGE_COMMANDS if subprocess.run(["which", c], capture_output=True).returncode
        ]
        if missing:
            pytest.skip(f"Slurm packages could not be installed (missing {missing}): {result.stderr.strip()}")
        raise RuntimeError(f"scripts/slurm-local up failed:\n{result.stdout}\n{result.stderr}")
    return Cluster(state, started=True)


def running_cluster():
    """Generator for a fixture: `yield from running_cluster()` gives a Cluster and stops it afterwards
    when this session started it."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        if cluster.started:
            slurm_local("down", cluster.state, timeout=120)
