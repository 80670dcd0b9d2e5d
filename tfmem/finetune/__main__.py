"""A training process of the `--memory-limit` supervisor: `python -m tfmem.finetune SPEC`."""

import sys

from tfmem.finetune.supervisor import child_main

if __name__ == "__main__":
    child_main(sys.argv[1])
