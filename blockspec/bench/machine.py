"""Where and how a measurement ran, recorded with every report: the CPU, threads, torch, device and load,
the command as typed, and the time."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    info = {
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "python": platform.python_version(), "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):  # other work on the machine skews timings: record how busy it was
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def command_line() -> str:
    """The command as typed: sys.argv, with `python -m blockspec` spelled out when run that way."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "blockspec":
        argv = [Path(sys.executable).name, "-m", "blockspec", *argv[1:]]
    return shlex.join(argv)


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
