"""python -m toolkit.job: the job on its batch host (the job script's last line); with
--successor-of, the job after its batch host is lost (toolkit/job/successor.py)."""

import sys

if "--successor-of" in sys.argv[1:]:
    from toolkit.job.successor import main as successor

    sys.exit(successor(sys.argv[1:]))

from toolkit.job.controller import main

sys.exit(main())
