"""`python -m scalarlm.cli ...` runs the same entry point as the `scalarlm` console script."""

import sys

from scalarlm.cli.main import main

sys.exit(main())
