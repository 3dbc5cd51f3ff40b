import sys

from blockspec.cli import main

sys.exit(main())
