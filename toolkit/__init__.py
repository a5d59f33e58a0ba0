"""ft: Slurm-native fine-tuning of LLMs on GPU clusters.

The login-node side (this package's CLI and API) must start fast: nothing here imports torch,
transformers, peft or deepspeed. The training runtime lives in modules that only the job imports.

    import toolkit
    run = toolkit.submit("recipes/tiny-lora-sft.yaml")
    run.wait(); print(run.state)
"""


def __getattr__(name):
    """`toolkit.__version__`, read where it is spelled (toolkit/base/build.py) only when asked: this
    file imports nothing, because a node's health hook runs a copy of it with toolkit/health/ alone."""
    if name == "__version__":
        from toolkit.base.build import VERSION

        return VERSION
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")


def submit(recipe, cluster=None, idempotency_key=None, preflight=False, skip_validation=False):
    """Validate, render and submit a recipe; returns a `toolkit.api.Run` handle."""
    from toolkit.api import submit as _submit

    return _submit(recipe, cluster, idempotency_key, preflight, skip_validation)


def run(run_id, cluster=None):
    """A handle on an existing run (`toolkit.api.Run`)."""
    from toolkit.api import run as _run

    return _run(run_id, cluster)
