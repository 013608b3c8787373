"""The identity of the stack a kernel was tuned on: GPU, architecture and software versions.

Everything here can change which config is fastest (or whether it compiles at all), so a stored
result is only reused on the same identity: the study name, the winners' key and the lookup's
staleness rule are all built from it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

NONE = "none"


@dataclass(frozen=True)
class Stack:
    """One machine's stack.

    Args:
        gpu (str): the device name (``"NVIDIA H200"``), ``"none"`` without a CUDA device.
        arch (str): the compute capability as a target name (``"sm_90"``), ``"none"`` without one.
        tilelang (str): the installed TileLang version.
        cuda (str): the CUDA toolkit that compiles the kernels (nvcc's release, else torch's).
        driver (str): the NVIDIA driver version, ``"none"`` without one.
        torch (str): the installed torch version.
    """

    gpu: str
    arch: str
    tilelang: str
    cuda: str
    driver: str
    torch: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def key(self) -> str:
        """A short readable name that changes whenever any field does."""
        digest = hashlib.sha256(repr(sorted(self.as_dict().items())).encode()).hexdigest()[:8]
        return f"{re.sub(r'[^A-Za-z0-9]+', '_', self.gpu)}-{digest}"


def has_gpu() -> bool:
    """Whether a CUDA device is usable by torch in this process."""
    import torch

    return torch.cuda.is_available()


@functools.cache
def current(device: int = 0) -> Stack:
    """The stack of this machine, as seen from CUDA device index ``device``."""
    import torch

    if has_gpu():
        major, minor = torch.cuda.get_device_capability(device)
        gpu, arch = torch.cuda.get_device_name(device), f"sm_{major}{minor}"
    else:
        gpu, arch = NONE, NONE
    return Stack(
        gpu=gpu,
        arch=arch,
        tilelang=_package_version("tilelang"),
        cuda=_nvcc_version() or torch.version.cuda or NONE,
        driver=_driver_version(),
        torch=torch.__version__,
    )


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NONE


def _nvcc_version() -> str | None:
    # TileLang compiles with the nvcc under CUDA_HOME when it is set, else the one on PATH.
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home and os.path.exists(os.path.join(home, "bin", "nvcc")) \
        else shutil.which("nvcc")
    if nvcc is None:
        return None
    out = _run([nvcc, "--version"])
    match = re.search(r"release [\d.]+, V([\d.]+)", out or "")
    return match.group(1) if match else None


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    out = _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"]) if smi else None
    return out.splitlines()[0].strip() if out and out.strip() else NONE


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
