"""``python -m worker --coordinator ADDR``: one worker; under torchrun, rank and world size come from its env."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker.worker import main  # noqa: E402

sys.exit(main())
