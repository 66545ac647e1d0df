#!/usr/bin/env python
"""Convert a PyTorch checkpoint (fla NSA, zen-E NSA-1B, HF Llama, EAGLE-3 head) into an ssv-jax bundle.

`--help` lists the options; key maps and caveats per format are in docs/CONVERSION.md. The implementation is
`ssv_jax.convert.main` (also the console entry point `ssv-convert`).
"""

import sys

from ssv_jax.convert import main

if __name__ == "__main__":
    sys.exit(main())
