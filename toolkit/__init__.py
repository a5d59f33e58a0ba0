"""ft: Slurm-native fine-tuning of LLMs on GPU clusters.

The login-node side (this package's CLI) must start fast: nothing here imports torch,
transformers, peft or deepspeed. The training runtime lives in modules that only the job imports.
"""

__version__ = "0.1.0"
