"""The training runtime: what runs inside the allocation (needs ft[train]: torch, transformers,
peft, deepspeed). Nothing on the login node imports this package."""
