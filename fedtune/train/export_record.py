"""What a train job exported, kept where Snakemake deletes nothing, so that the same job run again
restores it in seconds instead of training again (issue 48).

Snakemake deletes a job's outputs when it thinks them incomplete: a controller killed (SIGKILL, or
SIGINT to its PID alone) while its training jobs ran on and exported flags them so, and the rerun
(`reason: Forced execution`, or --rerun-incomplete) deletes `round-<r>/<site>/model` and runs the job
again. The checkpoints folder is no output, so the record lives there:

    <checkpoints>/export/
      record.json      the job's identity (below), when it exported, and every file's size
      model/           hard links to the files of --out (no second copy)
      optimizer/       hard links to the files of --optimizer-out, where the job writes one

The identity is what the job's result depends on: the site, round, rounds and lr schedule, the train
options (TrainOptions.to_dict(): the exported dtype, steps, lr, seed, geometry, ...; not those that only
change how the job runs: NO_EFFECT), the world size, the
summary-only flag, whether it keeps an optimizer state, and the content of what it reads: the start
model (--init), the manifests and their shards, and the previous optimizer state. A file of a read
folder counts by its bytes when it is small (configs, fedtune-checksums.json and counts.json, which hold
the sha256 of the large files) and by its size and modification time when it is large (weights, Arrow
files): an input made again, even with the same bytes, trains again; the record
never restores a result of other inputs. fedtune's code is not part of it (the record notes its hash):
a rerun after an update of fedtune restores what the older code exported, as Snakemake itself does not
rerun a finished job for a changed package; delete the checkpoints folder to train with the new code.

How long it is kept: one record per checkpoints folder, i.e. per (round, site). It is replaced by that
folder's next export, removed when a job of another identity starts training there, and otherwise kept
with the run (`remove_checkpoints` removes the step folders only). While the model folder exists it costs
no disk (the same inodes); deleting `round-<r>/<site>/model` alone frees nothing and the rerun restores it:
delete `round-<r>/<site>/checkpoints` too to train again or to free the space."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from fedtune.core.atomic import atomic_dir, write_json

FOLDER = "export"
RECORD = "record.json"
SMALL = 1 << 20  # files up to this size count by their bytes, larger ones by size and mtime
PACKAGE = Path(__file__).resolve().parent.parent
# Train options that change how a job runs, not what it exports: a rerun for a changed time limit, log
# interval or retry count restores.
NO_EFFECT = {
    "log_every", "checkpoint_every", "keep_checkpoints", "remove_checkpoints", "retries", "runtime", "mem_mb",
    "cpus_per_process",
}  # fmt: skip


def _file_entry(path: Path, root: Path) -> str:
    stat = path.stat()
    if stat.st_size <= SMALL:
        key = hashlib.sha256(path.read_bytes()).hexdigest()
    else:
        key = f"mtime {stat.st_mtime_ns}"
    return f"{path.relative_to(root)} {stat.st_size} {key}"


def _files(root: Path):
    """The plain files under root, sorted; tools' markers (.snakemake_timestamp) left out."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.name.startswith(".snakemake"):
            yield path


def content_identity(path: Path | None) -> str | None:
    """One sha256 over a file's or a folder's files (see the module's doc); None for no path."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        lines = [_file_entry(path, path.parent)]
    elif path.is_dir():
        lines = [_file_entry(p, path) for p in _files(path)]
    else:
        return "missing"
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def code_identity() -> str:
    """fedtune's Python code: another version of the package trains again."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def job_identity(args, options, plan, world_size: int) -> dict:
    """The identity of a train job (args: fedtune.train.loop.TrainJob, options: TrainOptions, plan:
    RoundPlan): equal for a rerun of the same job, different when anything its result depends on changed."""
    from fedtune.tokenize.blocks import manifest_shards

    manifests = []
    for manifest in args.manifest:
        shards = manifest_shards(manifest)
        manifests.append(
            {"manifest": content_identity(manifest), "shards": [content_identity(s) for s in shards]}
        )
    return {
        "site": args.site,
        "round": plan.round,
        "rounds": plan.rounds,
        "lr_schedule": plan.lr_schedule,
        "options": {k: v for k, v in options.to_dict().items() if k not in NO_EFFECT},
        "world_size": world_size,
        "summary_only": args.summary_only,
        # Where the outputs go is the checkpoints folder's (one per round and site), not the identity's.
        "optimizer_out": args.optimizer_out is not None,
        "init": content_identity(args.init),
        "manifests": manifests,
        "optimizer_in": content_identity(args.optimizer_in),
    }


def folder(checkpoints: Path) -> Path:
    return Path(checkpoints) / FOLDER


def _outputs(args) -> dict[str, Path]:
    outputs = {"model": Path(args.out)}
    if args.optimizer_out:
        outputs["optimizer"] = Path(args.optimizer_out)
    return outputs


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link every file of source into target (made), keeping the folders."""
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
            destination.chmod(path.stat().st_mode & 0o7777)
        elif path.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, destination)


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in _files(root)}


def write(args, identity: dict, summary: dict | None = None) -> Path | None:
    """Record the job's exported outputs (rank 0, after every output is written). Returns the record's
    folder, or None where hard links cannot be made (another file system): then nothing is kept."""
    target = folder(args.checkpoints)
    outputs = _outputs(args)
    try:
        with atomic_dir(target) as tmp:
            files = {}
            for name, path in outputs.items():
                _link_tree(path, tmp / name)
                files[name] = _sizes(path)
            record = {
                "identity": identity,
                "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": os.uname().nodename,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "steps": (summary or {}).get("steps"),
                # For the reader, not matched: see the module's doc.
                "code": code_identity(),
                "files": files,
            }
            write_json(tmp / RECORD, record)
    except OSError as error:
        print(f"export record: not kept ({error}); a rerun of this job would train again", flush=True)
        return None
    return target


def read(checkpoints: Path) -> dict | None:
    try:
        return json.loads((folder(checkpoints) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def differences(saved: dict, identity: dict) -> list[str]:
    return sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))


def matches(checkpoints: Path, identity: dict) -> dict | None:
    """The record of this identity with every recorded file present at its size, or None."""
    record = read(checkpoints)
    if record is None or record.get("identity") != identity:
        return None
    root = folder(checkpoints)
    for name, files in record["files"].items():
        if _sizes(root / name) != files:
            return None
    return record


def restore(args, record: dict) -> None:
    """Put the recorded outputs back under their names (hard links, each output folder replaced in one
    rename)."""
    root = folder(args.checkpoints)
    for name, path in _outputs(args).items():
        with atomic_dir(path) as tmp:
            tmp.chmod((root / name).stat().st_mode & 0o7777)
            for child in list(tmp.iterdir()):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            _link_tree(root / name, tmp)


def remove(checkpoints: Path) -> None:
    shutil.rmtree(folder(checkpoints), ignore_errors=True)
