"""Who this process is in the job (rank, node, device) and the process group, however it was started:
torchrun (local or one per node), srun with one task per process, or a plain `python` (one process)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from fedtune.core.accelerators import UnsupportedDeviceError, check_device, check_driver
from fedtune.core.options import UserError


class LaunchError(UserError, RuntimeError):
    """The process was started in a way that cannot form a job: the message says which variable."""


@dataclass(frozen=True)
class Job:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    hostname: str

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def hostname() -> str:
    # Slurm's node name is what `scontrol show hostnames` and the logs of the job use.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"{name} is not set; start through scripts/launch or torchrun")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(choice: str, local_rank: int) -> torch.device:
    try:
        check_driver()  # a driver too old for the build hides every GPU: "auto" would train on the CPU
    except UnsupportedDeviceError as e:
        raise LaunchError(str(e)) from None
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LaunchError("device: cuda was asked for, but PyTorch sees no CUDA device")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            check_device(device)
        except UnsupportedDeviceError as e:
            raise LaunchError(str(e)) from None
        return device
    return torch.device("cpu")


def start(device_choice: str = "auto", timeout_minutes: int = 30) -> Job:
    """Join the process group described by the environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a bare `python` becomes a job of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size or world_size % local_world_size:
        raise LaunchError(
            f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_WORLD_SIZE={local_world_size}: need 0 <= RANK < "
            "WORLD_SIZE and the same number of processes on every node"
        )
    device = pick_device(device_choice, local_rank)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=timeout_minutes))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
    return Job(rank, world_size, local_rank, local_world_size, device, hostname())


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a training process whose outputs are written (or whose checkpoint is, for 75) without the
    interpreter's teardown. Objects that outlive destroy_process_group (DeepSpeed's and DeviceMesh's
    handles on the gloo/NCCL backends) are otherwise destroyed during finalization, where a backend's
    worker thread can abort the process ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#179291) after every file is in place: the job would fail and Snakemake would throw
    away a finished model. Nothing here needs finalization: no worker processes, trackers closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def barrier() -> None:
    dist.barrier()
