"""How an ft job's processes end, and what each ending costs: the one table the workers, the
launchers, the supervisor and the job script follow.

    code  meaning                          what happens
    0     done                             the run is finished (a `done` mark: never rerun)
    1     a launcher failed                the step ends; restarted as below ("other")
    3     a node failed its checks         the launcher's node is unfit before any rank starts
    4     user error (NaN loss, bad data)  stop: a restart would fail the same way
    5     out of memory                    the job script retries once with a smaller micro batch
    6     a rank hung                      restart from the latest checkpoint, same nodes
    7     lost nodes, no spare left        the job script requeues the job without them
    8     stopped on request, checkpointed the job script requeues the job (preempted, or the time
                                           limit near), which resumes from that checkpoint
    other a rank died, a collective broke  restart from the latest checkpoint, same nodes, with a
                                           backoff, at most watchdog.max_restarts times

The rank or launcher that ends a step first leaves its code in <run dir>/exit-status
(RunLayout.leave_exit_status): srun itself
reports the highest code of its tasks, and the ones it stopped because another failed count as
terminated (15), which would hide the cause.
"""

from __future__ import annotations

DONE = 0
LAUNCH_FAILED = 1
NODE_UNFIT = 3
USER_ERROR = 4
OUT_OF_MEMORY = 5
HUNG = 6
NODES_LOST = 7
STOPPED = 8
NOT_RESTARTED = {USER_ERROR, OUT_OF_MEMORY, STOPPED}


class RunEnds(Exception):
    """Training ends before its last step: `code` is the exit status (the table above)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
