"""``python -m trainer`` / ``torchrun --nproc_per_node N -m trainer``: the same options as ``polarstream train``.

The entry point lives here, not in train.py, so that train.py (the loop) and cli.py (its options) do not
import each other: cli imports train when it runs, and nothing imports cli but this and the root command.
"""

from .cli import main

main()
