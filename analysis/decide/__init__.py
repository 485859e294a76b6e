"""Decisions: the recommendation, model checks, the capacity plan and its validation."""
