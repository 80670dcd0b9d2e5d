"""Print what tfmem sees on this machine: paste the output into bug reports.

    python scripts/env_report.py              # same as the installed `tfmem-env` command
    python scripts/env_report.py --prefer cpu

Any machine; prints about 20 lines in a few seconds (most of it importing TensorFlow).
"""

import sys

from tfmem.runtime.report import main

if __name__ == "__main__":
    sys.exit(main())
