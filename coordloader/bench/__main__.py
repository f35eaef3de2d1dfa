import sys

from coordloader.bench.cli import main

sys.exit(main())
