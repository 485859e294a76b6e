"""Offline text sources shared by training and the load generator (CPython stdlib, Python docs, HumanEval)."""
