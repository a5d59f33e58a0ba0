"""Rendering the sbatch script of a run from sbatch_templates/."""
