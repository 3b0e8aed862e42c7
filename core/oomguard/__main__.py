import sys

from oomguard.cli import main

sys.exit(main())
