"""`python -m batchgen_data.cli run ...`: the command without the installed script."""
import sys

from batchgen_data.cli.main import main

sys.exit(main())
