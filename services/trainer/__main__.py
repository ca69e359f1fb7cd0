"""``python -m services.trainer --config JOB.yaml [--port 50051] [--redis-url URL] [--resume CKPT] ...``"""

from services.common.runtime import main
from services.trainer.server import SPEC

if __name__ == "__main__":
    main(SPEC)
