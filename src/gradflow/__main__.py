"""``python -m gradflow`` (also what torchrun launches: ``torchrun ... -m gradflow record ...``)."""

import sys

from gradflow.cli import main

sys.exit(main())
