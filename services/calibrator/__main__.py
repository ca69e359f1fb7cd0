"""``python -m services.calibrator --config JOB.yaml [--port 50054] [--redis-url URL] [--replica-id ID] ...``"""

from services.calibrator.server import SPEC
from services.common.runtime import main

if __name__ == "__main__":
    main(SPEC)
