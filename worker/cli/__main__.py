import sys

from worker.cli import main

sys.exit(main())
