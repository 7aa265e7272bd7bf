"""``python -m torchloom`` is the ``torchloom`` command."""

import sys

from torchloom._cli import main

sys.exit(main())
