"""`ft doctor`: is this user's setup of a cluster able to run ft? Checks from the login node
(login.py) and from compute nodes through a short preflight step (preflight.py runs
toolkit/doctor/node.py there, with the training environment's interpreter); each finding says
what is wrong and the command that fixes it (findings.py)."""
