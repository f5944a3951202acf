"""``python -m megatron_empg.rollout.retriever serve|stop``: the command line of ``cli``."""

import sys

from megatron_empg.rollout.retriever.cli import main

if __name__ == "__main__":
    sys.exit(main())
