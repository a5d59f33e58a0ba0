"""The job on its batch host: one typed program from the job script's last line to the job's end.

The job script only says what the job is (its #SBATCH lines, the run spec, the environment) and
starts `python -m toolkit.job`; everything it then decides lives here, each decision with one owner
(the training step it starts is typed in the run spec: toolkit/recipe/job_plan.py):

- supervise.py   the watchdog's supervisor: the training step under heartbeats, restarts in the
                 allocation, a lost node replaced by a spare (adopted.py: a step it adopts);
- losses.py      which nodes a failed step launch lost, and how many such losses in a row the run
                 may take without progress;
- controller.py  the job itself: the step (under the watchdog, toolkit/job/supervise.py), the
                 time limit and Slurm's signals, and what each ending costs (toolkit/runs/exits.py):
                 a requeue without lost nodes, one retry out of memory, a stop;
- successor.py   the job after its batch host is lost while training goes on elsewhere: the
                 controller again, in a step on a surviving node, adopting the running training step.
"""
