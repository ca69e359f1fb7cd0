"""``python -m services.rollout --config JOB.yaml [--port 50052] [--redis-url URL] [--replica-id ID] ...``"""

from services.common.runtime import main
from services.rollout.server import SPEC

if __name__ == "__main__":
    main(SPEC)
