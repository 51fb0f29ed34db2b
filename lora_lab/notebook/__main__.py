"""`python -m lora_lab.notebook [--out DIR] [-p NAME VALUE ...] [NAME ...]`: see runner.py."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
