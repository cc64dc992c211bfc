"""``python -m treeattn``: the ``treeattn`` command, for launchers that start a module.

``torchrun --nproc-per-node 8 -m treeattn generate ...`` runs one rank per process; the
console script ``treeattn`` and this entry point share :func:`treeattn.cli.main`.
"""

import sys

from treeattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
