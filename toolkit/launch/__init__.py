"""What runs on each node of the allocation: ft's per-node launcher (`python -m toolkit.launch`,
node.py), the ranks it starts and watches (workers.py), the node's warm template that forks them
with the training runtime already imported (warm.py), the rendezvous and the hand-over of a lost
batch host's role to a spare (rendezvous.py, handover.py)."""
