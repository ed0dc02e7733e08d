"""``python bench/run.py ...`` is ``fastft bench ...``: the side-by-side benchmark (see README.md here)."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # This folder is sys.path[0] when run as a script; keep it off so nothing here shadows an installed package.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]
    from fastft.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
