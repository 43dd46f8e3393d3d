"""What this machine has free: RAM and VRAM."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



def free_ram() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_vram(device: torch.device) -> int:
    import torch

    return torch.cuda.mem_get_info(device)[0]
