"""The environment a checkpoint was written in, recorded in every manifest."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import numpy as np
import torch

from . import __version__


def fingerprint() -> dict[str, Any]:
    """Versions, host and world size: what to compare when a resumed run behaves differently."""
    env: dict[str, Any] = {
        "unbroken": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "rank": int(os.environ.get("RANK", "0")),
    }
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env
