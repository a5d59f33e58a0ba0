"""Recipes: one fine-tuning run as a typed, validated document (recipes/*.yaml)."""
