import sys

from dsv4core.cli import main

sys.exit(main())
