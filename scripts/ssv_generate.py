"""Generate with Sparse Speculative Verification: the main job. See `ssv_jax/generate_cli.py` (`--help`)."""

import sys

from ssv_jax.generate_cli import main

if __name__ == "__main__":
    sys.exit(main())
