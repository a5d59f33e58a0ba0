"""ft: Slurm-native fine-tuning of LLMs on GPU clusters.

The login-node side (this package's CLI and API) must start fast: nothing here imports torch,
transformers, peft or deepspeed. The training runtime lives in modules that only the job imports.

    import toolkit
    run = toolkit.submit("recipes/tiny-lora-sft.yaml")
    run.wait(); print(run.state)
"""

__version__ = "0.1.0"


def submit(recipe, cluster=None, idempotency_key=None, preflight=False, skip_validation=False):
    """Validate, render and submit a recipe; returns a `toolkit.api.Run` handle."""
    from toolkit.api import submit as _submit

    return _submit(recipe, cluster, idempotency_key, preflight, skip_validation)


def run(run_id, cluster=None):
    """A handle on an existing run (`toolkit.api.Run`)."""
    from toolkit.api import run as _run

    return _run(run_id, cluster)
