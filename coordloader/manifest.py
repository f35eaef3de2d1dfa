"""`python -m coordloader.manifest CKPT` (the command lives in `coordloader.cli.manifest`)."""
import sys

from coordloader.cli.manifest import main

if __name__ == "__main__":
    sys.exit(main())
