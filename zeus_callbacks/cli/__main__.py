"""`python -m zeus_callbacks.cli`."""

import sys

from zeus_callbacks.cli import main

sys.exit(main())
