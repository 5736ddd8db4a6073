import sys

from kvcompile.cli import main

sys.exit(main())
