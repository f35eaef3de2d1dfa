"""`torchrun -m coordloader.load CKPT ...` (the command lives in `coordloader.cli.load`;
the library function is `coordloader.load`, from `coordloader.loader`)."""
import sys

from coordloader.cli.load import main
from coordloader.cli.shim import make_callable
from coordloader.loader import load

make_callable(__name__, load)

if __name__ == "__main__":
    sys.exit(main())
