import sys

from eval.replay.cli import main

sys.exit(main())
