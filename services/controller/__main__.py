"""``python -m services.controller --config JOB.yaml --trainer H:P --reward H:P --calibrator H:P [--port 50050] ...``"""

from services.common.runtime import main
from services.controller.server import SPEC

if __name__ == "__main__":
    main(SPEC)
