"""What a pool's fork server imports first (fork_server.py's PRELOAD): the quiet the command asked for
(`STREAMFUSION_QUIET`, as the ranks read it), so that the libraries it imports next, once for every rank, print
none of what a spawned rank's imports would not print either."""
from __future__ import annotations

import os
import warnings

from ..core.logs import quiet_noisy_loggers

if os.environ.get("STREAMFUSION_QUIET"):
    quiet_noisy_loggers()
    warnings.filterwarnings("ignore", module=r"(?!streamfusion_diffusers)")
