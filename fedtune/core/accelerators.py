"""Whether this torch build can drive this GPU, asked before any work starts.

A CUDA wheel carries kernels for a fixed list of GPU architectures (`torch.cuda.get_arch_list()`). A
GPU missing from the list is still visible and `is_available()` is True, but every kernel fails at
launch. PyTorch's CUDA 12.8 and 13.0 wheels dropped Volta (sm_70, the V100s of Iris) from 2.11 on
(pytorch/pytorch#172352), so the pinned default wheel cannot train there.
"""

from __future__ import annotations

from fedtune.core.options import UserError

# Where a build that drives each architecture comes from, for the error message. Volta's last wheels:
# the CUDA 12.6 builds (2.11 and later dropped sm_70 only from the 12.8 and 13.0 builds).
BUILD_HINTS = {
    (7, 0): (
        "install a CUDA 12.6 build, e.g. `pip install torch==<version> --index-url "
        "https://download.pytorch.org/whl/cu126` (envs/README.md: the torch build per cluster)"
    ),
}
DEFAULT_HINT = (
    "install a torch build whose `torch.cuda.get_arch_list()` lists it "
    "(https://pytorch.org/get-started/locally/ names the CUDA builds)"
)


class UnsupportedDeviceError(UserError, RuntimeError):
    """The torch build has no kernels for this GPU: the message names the GPU, the build and the fix."""


def _covers(arch_list: list[str], major: int, minor: int) -> bool:
    """Whether a build with these targets runs on an sm_<major><minor> GPU: its own sm_XY, or PTX
    (`compute_XY`) of the same major version or older, which the driver compiles for newer GPUs."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if not number.isdigit():
            continue
        arch_major, arch_minor = int(number[:-1]), int(number[-1])
        if kind == "sm" and (arch_major, arch_minor) == (major, minor):
            return True
        # A cubin for sm_XY also runs on sm_XZ with Z >= Y (same major): binary compatibility.
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


# The oldest NVIDIA driver that runs each CUDA major version's wheels, through CUDA's minor-version
# compatibility (NVIDIA, CUDA Toolkit release notes, "CUDA Toolkit and Corresponding Driver Versions"):
# the CUDA 12.6 build (Iris) needs >= 525.60.13, the CUDA 13.0 build (the default wheel: Leonardo,
# Karolina, MeluXina) >= 580.65.06. envs/README.md has the table per cluster.
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}


def _driver_cuda_version() -> int:
    """The CUDA version the installed NVIDIA driver supports (the driver API's cuDriverGetVersion, from
    libcuda.so.1, which the driver installs: 12040 is 12.4), or 0 when there is no driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return 0
    return version.value


def _driver_name() -> str:
    """The NVIDIA driver's version number as the kernel module reports it, or "" when unknown."""
    try:
        with open("/proc/driver/nvidia/version") as stream:
            words = stream.readline().split()
    except OSError:
        return ""
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), "")


def check_driver() -> None:
    """Raise UnsupportedDeviceError when a CUDA torch build runs on a node whose NVIDIA driver is too old
    for it (torch then sees no GPU, and training would fall back to the CPU or fail much later)."""
    import torch

    built = torch.version.cuda
    driver = _driver_cuda_version()
    if not built or not driver:
        return
    major = int(built.split(".")[0])
    if driver // 1000 >= major:
        return
    name = _driver_name()
    raise UnsupportedDeviceError(
        f"the NVIDIA driver{' ' + name if name else ''} supports CUDA {driver // 1000}.{driver % 1000 // 10}, "
        f"but torch {torch.__version__} is built for CUDA {built}, which needs a driver >= "
        f"{MIN_DRIVER.get(major, 'of CUDA ' + str(major))}: install the build for this cluster "
        "(scripts/setup-env with FEDTUNE_CLUSTER; envs/README.md: the torch build per cluster) or ask "
        "the site for a newer driver"
    )


def check_device(device) -> None:
    """Raise UnsupportedDeviceError when `device` is a CUDA GPU the running torch build has no kernels
    for, or (on any device: torch sees no GPU then) when the NVIDIA driver is too old for the build;
    CPU and other devices pass."""
    import torch

    check_driver()
    device = torch.device(device)
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    arch_list = list(torch.cuda.get_arch_list())
    if not arch_list or _covers(arch_list, major, minor):
        # An empty list: a build without the query (or a ROCm build): nothing to check against.
        return
    name = torch.cuda.get_device_name(index)
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    hint = BUILD_HINTS.get((major, minor), DEFAULT_HINT)
    raise UnsupportedDeviceError(
        f"GPU {index} ({name}, sm_{major}{minor}) is not supported by {build}, built for "
        f"{' '.join(arch_list)}: every kernel would fail at launch; {hint}"
    )
