import sys

from tilefuse.cli import main

sys.exit(main())
