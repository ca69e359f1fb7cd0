"""``python -m services.trainer --config JOB.yaml [--port 50051] [--redis-url URL] [--resume CKPT] ...``

Under ``torchrun --nproc-per-node N`` (``policy.training.dp_size: N``) rank 0 serves and ranks 1..N-1 follow it
(:mod:`services.trainer.ranks`).
"""

import os
import sys

from services.common.runtime import main
from services.trainer.server import SPEC

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:
        from services.trainer.ranks import follower_main

        sys.exit(follower_main(SPEC))
    main(SPEC)
