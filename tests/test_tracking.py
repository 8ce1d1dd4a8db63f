"""fedtune.core.tracking: rows like the train loop's loss.csv, evaluate's and aggregate's results, sent through
each backend and read back with the library's own reader (TensorBoard's EventAccumulator; the W&B
offline run's .wandb file decoded with wandb's protobuf messages), compared with what was sent."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from fedtune.core import tracking
from fedtune.core.options import ConfigError
from fedtune.run.config import check_config

from .workflow_harness import demo_config

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None
needs_tensorboard = pytest.mark.skipif(
    not HAVE_TENSORBOARD, reason="tensorboard missing: pip install -e '.[tracking]'"
)
needs_wandb = pytest.mark.skipif(not HAVE_WANDB, reason="wandb missing: pip install -e '.[tracking]'")


def loss_rows(steps: int = 12) -> list[str]:
    """Rows formatted exactly as fedtune.train.loop formats them."""
    rows = []
    for step in range(1, steps + 1):
        loss, lr, grad_norm, tps, peak = (
            6.5 - 0.13 * step,
            3e-3 * min(1, step / 4),
            1.5 / step,
            15000.0 + step,
            812.5,
        )
        rows.append(f"{step},{1 + (step > 6)},{loss:.6f},{lr:.6e},{grad_norm:.6f},{tps:.1f},{peak:.1f}\n")
    return rows


def as_numbers(row: str) -> dict:
    names = tracking.LOSS_HEADER.split(",")
    return {name: float(value) for name, value in zip(names, row.strip().split(","), strict=True)}


EVAL_RESULT = {
    "model": "aggregate", "model_dir": "x", "round": 1, "site": "beta", "task": "causal-lm", "data": "d",
    "split": "test", "perplexity": 17.25, "bits_per_byte": 1.125, "tokens": 4096, "wall_time_s": 2.5,
}  # fmt: skip
AGGREGATE_RECORD = {
    "method": "fedavg", "dtype": "float32", "inputs": [{}, {}], "warnings": [], "wall_time_s": 0.75,
    "weights": {"source": "tokens", "raw": {"alpha": 3, "beta": 1}, "normalised": {"alpha": 0.75, "beta": 0.25}},
}  # fmt: skip
SUMMARY = {"site": "alpha", "steps": 12, "final_loss": 4.94, "wall_time_s": 33.0, "options": {"lr": 0.003}}


def drive(backend: str, run_dir: Path, **extra) -> list[str]:
    """What a training job, an evaluate job and an aggregate job of round 1 would send."""
    options = {"backend": backend, **extra}
    rows = loss_rows()
    where = tracking.TrackedRun("demo", 1, "alpha", run_dir)
    with tracking.start(options, where, "train", {"lr": 0.003}) as tracker:
        for row in rows:
            tracker.log(*tracking.loss_row_metrics(row))
        tracker.log_summary(SUMMARY)
    tracking.log_evaluation(options, EVAL_RESULT, run="demo", run_dir=run_dir)
    tracking.log_aggregate(options, AGGREGATE_RECORD, tracking.TrackedRun("demo", 1, run_dir=run_dir))
    return rows


def test_loss_row_metrics_reads_train_rows():
    step, metrics = tracking.loss_row_metrics(loss_rows()[4])
    assert (
        step == 5
        and metrics["train/loss"] == pytest.approx(5.85)
        and set(metrics) == {f"train/{name}" for name in tracking.LOSS_HEADER.split(",")[1:]}
    )
    with pytest.raises(tracking.TrackingError, match="3 values"):
        tracking.loss_row_metrics("1,2,3")


def test_the_section_is_typed_with_the_schema_defaults_and_bad_values_are_named():
    from fedtune.core.tracking_options import TrackingOptions
    from fedtune.run.config import build_run_config

    run = build_run_config(demo_config())
    assert run.tracking == TrackingOptions("none", None, None, None, "offline", 1)
    assert not run.tracking.on
    # The stage CLIs' --tracking JSON round-trips to the same object.
    resolved = dataclasses.replace(run.tracking, backend="tensorboard", dir="/tmp/t")
    assert TrackingOptions.from_json(resolved.to_json()) == resolved
    with pytest.raises(ConfigError, match="tracking.backend"):
        check_config(demo_config(tracking={"backend": "mlflow"}))
    # A mapping given to the module (a CLI's JSON) is checked by the same schema.
    with pytest.raises(ConfigError, match="tracking.backend: 'mlflow'"):
        tracking.from_options({"backend": "mlflow"}, group="demo", job_type="train")
    with pytest.raises(ConfigError, match="colour"):
        tracking.from_options({"colour": "red"}, group="demo", job_type="train")


def test_backend_none_writes_nothing(tmp_path):
    drive("none", tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_tensorboard
def test_tensorboard_event_files_hold_the_loss_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = drive("tensorboard", tmp_path)
    root = tmp_path / "tracking" / "tensorboard" / "demo" / "round-1"

    def scalars(site: str) -> EventAccumulator:
        events = EventAccumulator(str(root / site), size_guidance={"scalars": 0})
        events.Reload()
        return events

    train = scalars("alpha")
    for column in tracking.LOSS_HEADER.split(",")[1:]:
        logged = train.Scalars(f"train/{column}")
        assert [e.step for e in logged] == [int(as_numbers(r)["step"]) for r in rows]
        # Event files store float32.
        assert [e.value for e in logged] == pytest.approx([as_numbers(r)[column] for r in rows], rel=1e-6)
    assert train.Scalars("summary/final_loss")[0].value == pytest.approx(4.94)
    assert train.Scalars("summary/options/lr")[0].value == pytest.approx(0.003)
    merged = scalars("aggregate")
    assert merged.Scalars("eval/beta/perplexity")[0].value == pytest.approx(17.25)
    assert merged.Scalars("eval/beta/perplexity")[0].step == 1
    assert merged.Scalars("aggregate/weight/alpha")[0].value == pytest.approx(0.75)


@needs_tensorboard
def test_log_every_thins_training_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    drive("tensorboard", tmp_path, log_every=4)
    events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / "demo" / "round-1" / "alpha"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 12]


def wandb_records(path: Path) -> list:
    """Every record of a .wandb file: LevelDB's log framing (32 KiB blocks of 7-byte-headed chunks)
    after W&B's 7-byte header, each record a wandb.proto Record message."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: no W&B header"
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(root: Path, job_type: str) -> dict:
    """The offline run of `job_type`: its name, group, history rows by step and summary."""
    for path in root.glob("wandb/offline-run-*/*.wandb"):
        run, history, summary = None, {}, {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                items = {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item
                }
                history[int(items.pop("_step"))] = items
            elif kind == "summary":
                for i in record.summary.update:
                    summary["/".join(i.nested_key) or i.key] = json.loads(i.value_json)
        if run is not None and run.job_type == job_type:
            return {"name": run.display_name, "group": run.run_group, "history": history, "summary": summary}
    raise AssertionError(f"no {job_type} run under {root}")


@needs_wandb
def test_wandb_offline_run_holds_the_loss_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    rows = drive("wandb", tmp_path, project="fedtune-test")
    root = tmp_path / "tracking"
    train = wandb_run(root, "train")
    assert (train["name"], train["group"]) == ("demo/round-1/alpha", "demo")
    assert sorted(train["history"]) == list(range(1, 13))
    for row in rows:
        sent = as_numbers(row)
        logged = train["history"][int(sent.pop("step"))]
        assert {k: logged[f"train/{k}"] for k in sent} == pytest.approx(sent, rel=1e-12)
    assert train["summary"]["final_loss"] == 4.94 and train["summary"]["options/lr"] == 0.003
    evaluation = wandb_run(root, "evaluate")
    assert evaluation["name"] == "demo/round-1/aggregate"
    assert evaluation["history"][1]["eval/beta/perplexity"] == 17.25
    assert evaluation["summary"]["eval/beta/bits_per_byte"] == 1.125
    merged = wandb_run(root, "aggregate")
    assert (
        merged["summary"]["aggregate/weight/beta"] == 0.25
        and merged["summary"]["aggregate/method"] == "fedavg"
    )


@needs_tensorboard
def test_cli_sends_a_finished_stage_from_its_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = tmp_path / "round-1" / "alpha" / "model"
    model.mkdir(parents=True)
    rows = loss_rows(7)
    (model / "loss.csv").write_text(tracking.LOSS_HEADER + "\n" + "".join(rows))
    (model / "training.json").write_text(json.dumps(SUMMARY))
    (tmp_path / "aggregate.json").write_text(json.dumps(AGGREGATE_RECORD))
    options = json.dumps({"backend": "tensorboard", "dir": str(tmp_path / "tracked")})
    common = ["--tracking", options, "--run-name", "demo", "--round", "1"]
    assert tracking.main(["training", "--path", str(model), "--site", "alpha", *common]) == 0
    assert tracking.main(["aggregate", "--path", str(tmp_path / "aggregate.json"), *common]) == 0
    root = tmp_path / "tracked" / "tensorboard" / "demo" / "round-1"
    events = EventAccumulator(str(root / "alpha"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx(
        [as_numbers(r)["grad_norm"] for r in rows], rel=1e-6
    )
    events = EventAccumulator(str(root / "aggregate"))
    events.Reload()
    assert events.Scalars("aggregate/weight/beta")[0].value == pytest.approx(0.25)
    # Mistakes are named, not tracebacks.
    assert tracking.main(["training", "--path", str(model), *common]) == 2
    assert tracking.main(["aggregate", "--path", str(tmp_path / "none.json"), *common]) == 2
