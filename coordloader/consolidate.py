"""`python -m coordloader.consolidate SRC OUT` (the command lives in
`coordloader.cli.consolidate`; the library function is `coordloader.consolidate`, from
`coordloader.handoff.consolidate`)."""
import sys

from coordloader.cli.consolidate import main
from coordloader.cli.shim import make_callable
from coordloader.handoff.consolidate import consolidate

make_callable(__name__, consolidate)

if __name__ == "__main__":
    sys.exit(main())
