"""python -m toolkit.job: the job on its batch host (the job script's last line)."""

import sys

from toolkit.job.controller import main

sys.exit(main())
