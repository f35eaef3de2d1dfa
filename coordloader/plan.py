"""`python -m coordloader.plan CKPT ...` (the command lives in `coordloader.cli.plan`)."""
import sys

from coordloader.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
