"""``python -m worker --coordinator ADDR``: one worker; under torchrun, rank and world size come from its env."""

import sys

from worker.worker import main

sys.exit(main())
