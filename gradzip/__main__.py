import sys

from gradzip.cli import main

sys.exit(main())
