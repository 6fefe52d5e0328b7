import sys

from normswap.cli import main

sys.exit(main())
