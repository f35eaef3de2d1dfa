import sys

from coordloader.cli.synth import main

sys.exit(main())
