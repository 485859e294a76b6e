"""``python -m loadgen``: flags -> target -> the run's phases; the consistency check."""
