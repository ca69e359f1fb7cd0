"""``python -m services.reward --config JOB.yaml [--port 50053] [--grader NAME] [--timeout-s S] ...``"""

from services.common.runtime import main
from services.reward.server import SPEC

if __name__ == "__main__":
    main(SPEC)
