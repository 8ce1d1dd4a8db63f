"""The two-cluster run rehearsed on one machine: the demo's two sites (it, cs) on two "clusters" with a
run folder and a Snakemake controller each, as on Leonardo and Karolina. `leo` trains it, aggregates and
reaches `karo` (site cs) over real SSH (a local sshd on a free port, with keys made for the rehearsal);
karo logs in nowhere and receives each aggregate by push, as config/examples/llama2-it-cs.yaml sets up.
leo's two keys are confined as docs/transfers.md tells karo's admin to (scripts/fedtune-rsync-gate): the
pull key read-only on karo's exchange/outbox, the push key (federation.remotes.karo.push_path)
write-only on its exchange/inbox.
(Named leo and karo: scripts/clusters/leonardo.sh and karolina.sh need the real clusters' scratch.)

    scripts/rehearse                       # 3 rounds of 3 steps, about 5 minutes on 2 cores
    scripts/rehearse --dry-run             # the two controllers' plans only (no sshd needed)

tests/test_multicluster.py runs the same set-up and checks its result against a one-cluster run. It runs
from a checkout of the repository (the demo's config, the Snakefile, profiles/local), as
`python -m fedtune.tools.rehearsal` or scripts/rehearse."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fedtune.core import cli
from fedtune.tools.local_sshd import authorized_key_lines, find_sshd, start_sshd, stop_sshd

ROOT = Path(__file__).resolve().parents[2]  # the repository: fedtune/tools/rehearsal.py
DEMO = ROOT / "config" / "config.yaml"
RUN = "rehearsal"
CLUSTERS = {"leo": "it", "karo": "cs"}  # cluster -> its site; leo aggregates


def lean_demo(rounds: int, steps: int) -> dict:
    """config/config.yaml, small: `rounds` rounds of `steps` steps, one shard, the last round evaluated on
    10 documents, no pooled baseline; data paths absolute, so it runs from any working directory."""
    config = yaml.safe_load(DEMO.read_text())
    config["run"] = RUN
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        site["dataset"]["data_files"] = {split: str(ROOT / path) for split, path in files.items()}
    config["tokenize"] = {**config["tokenize"], "shards": 1}
    config["train"] = {**config["train"], "max_steps": steps, "warmup_steps": 1}
    config["evaluate"] = {**config["evaluate"], "intermediate": "none", "max_documents": 10}
    config["federation"] = {"rounds": rounds, "pooled_baseline": False}
    if set(config["sites"]) != set(CLUSTERS.values()):
        raise SystemExit(f"rehearse: {DEMO} has sites {sorted(config['sites'])}, expected it and cs")
    return config


def write_clusters(out: Path, config: dict, host: str, push_host: str) -> dict[str, Path]:
    """One working directory per cluster, each with the same config but its own `cluster`: leo reaches
    karo's run folder through `host` to pull and `push_host` to push (a Host alias each, one key each)."""
    folders = {}
    karo_run = (out / "karo" / "results" / RUN).resolve()
    for cluster in CLUSTERS:
        workdir = out / cluster
        workdir.mkdir(parents=True, exist_ok=True)
        mine = {**config, "cluster": cluster}
        mine["sites"] = {name: {**site, "cluster": c} for c, name in CLUSTERS.items()
                         for site in [config["sites"][name]]}  # fmt: skip
        mine["federation"] = {**config["federation"], "aggregate_on": "leo", "wait": "30m",
                              "remotes": {"karo": {"path": f"{host}:{karo_run}", "transfer": "push",
                                                   "push_path": f"{push_host}:{karo_run}"}}}  # fmt: skip
        (workdir / "config.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
        folders[cluster] = workdir
    return folders


def controller(workdir: Path, *extra: str) -> list[str]:
    """The command a user runs on each login node (in tmux), with this cluster's folder."""
    return [
        sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
        str(workdir), "--configfile", str(workdir / "config.yaml"), "--profile",
        str(ROOT / "profiles" / "local"), *extra,
    ]  # fmt: skip


# What the rehearsal says when this machine has no sshd: it installs nothing itself (Debian's package also
# starts a system-wide sshd where systemd runs).
NO_SSHD = (
    "rehearse: no sshd on this machine: the rehearsal starts its own on a free port (its keys made for it), "
    "from Debian's openssh-server package. Install it, then run scripts/rehearse again:\n"
    "  sudo apt-get install openssh-server\n"
    "  sudo systemctl disable --now ssh    # where systemd runs: no system-wide sshd (the rehearsal needs none)\n"
    "`scripts/rehearse --dry-run` needs no sshd."
)


STEPS_DONE = re.compile(r"^(\d+) of (\d+) steps \((\d+%)\) done", re.M)
RULE = re.compile(r"^\s*(?:local)?rule (\w+):\n(?:\s+\S.*\n)*?\s+wildcards: (.*)$", re.M)


def progress(cluster: str, log: str) -> str | None:
    """One line on where a controller is, from its log (Snakemake's output): jobs done of all, and the
    newest job started. None before it planned its jobs."""
    done = STEPS_DONE.findall(log)
    started = RULE.findall(log)
    if not done and not started:
        return None
    line = f"{cluster}: {done[-1][0]} of {done[-1][1]} jobs done" if done else f"{cluster}: jobs started"
    if started:
        rule, wildcards = started[-1]
        line += f"; latest: {rule} ({wildcards})"
    return line


def wait_showing_progress(processes: dict, logs: dict[str, Path], every: float = 5.0) -> None:
    """Wait for the controllers, printing a line for a controller whenever its progress changes."""
    said: dict[str, str | None] = {}
    while True:
        running = [c for c, p in processes.items() if p.poll() is None]
        for cluster, path in logs.items():
            line = progress(cluster, path.read_text(errors="replace")) if path.is_file() else None
            if line and line != said.get(cluster):
                print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
                said[cluster] = line
        if not running:
            return
        time.sleep(every)


@cli.entry("fedtune.tools.rehearsal")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("results/rehearsal"), help="where both clusters' folders go"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per site and round")
    parser.add_argument("-n", "--dry-run", action="store_true", help="print both controllers' plans only")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    config = lean_demo(args.rounds, args.steps)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if args.dry_run:
        folders = write_clusters(out, config, "127.0.0.1", "fedtune-push")
        for cluster, workdir in folders.items():
            print(f"== {cluster} ({workdir})", flush=True)
            result = subprocess.run(controller(workdir, "-n", "--quiet", "rules"), env=env, cwd=workdir)
            if result.returncode:
                return result.returncode
        return 0

    sshd = find_sshd()
    if sshd is None:
        print(NO_SSHD, file=sys.stderr)
        return 2
    try:
        server = start_sshd(out / "sshd", sshd)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"rehearse: no local sshd: {error}") from None
    try:
        folders = write_clusters(out, config, server.host, server.push_host)
        # leo's keys, confined as docs/transfers.md tells karo's admin to.
        exchange = (out / "karo" / "results" / RUN / "exchange").resolve()
        (server.folder / "authorized_keys").write_text(authorized_key_lines(server, exchange))
        env["RSYNC_RSH"] = server.rsync_rsh
        processes = {}
        for cluster, workdir in folders.items():
            log = open(workdir / "controller.log", "w")  # noqa: SIM115 (open while the controller runs)
            processes[cluster] = subprocess.Popen(controller(workdir), cwd=workdir, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT)  # fmt: skip
            print(f"{cluster}: controller started, log {workdir / 'controller.log'}", flush=True)
        wait_showing_progress(processes, {c: folders[c] / "controller.log" for c in processes})
        failed = [c for c, p in processes.items() if p.wait() != 0]
    finally:
        stop_sshd(server)
    if failed:
        print(
            f"rehearse: the controller of {', '.join(failed)} failed: see its controller.log", file=sys.stderr
        )
        return 1
    leo, karo = (folders[c] / "results" / RUN for c in CLUSTERS)
    same = all(
        {p.name: p.read_bytes() for p in (leo / f"round-{r}" / "aggregate" / "model").glob("*.safetensors")}
        == {
            p.name: p.read_bytes()
            for p in (karo / f"round-{r}" / "aggregate" / "model").glob("*.safetensors")
        }
        # Every round's, the last one's too: karo scores it on beta's text (evaluate.cross_site none).
        for r in range(1, args.rounds + 1)
    )
    print(f"done: the report is in {leo / 'report'}; karo received the aggregates of rounds 1-{args.rounds}"
          f" {'byte for byte' if same else 'WITH DIFFERENT BYTES'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
