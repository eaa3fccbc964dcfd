"""`python -m dflash_jax.device_report`: the prepared GPU run, kept at its first documented path (the code lives in
`dflash_jax.bench.device_report`)."""

import sys

from dflash_jax.bench.device_report import main

if __name__ == "__main__":
    main(sys.argv[1:])
