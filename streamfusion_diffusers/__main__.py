"""`python -m streamfusion_diffusers ...` (what torchrun runs) is the `streamfusion` command."""
import sys

from .cli import main

sys.exit(main())
