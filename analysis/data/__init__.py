"""Loading a run and per-cell metrics: the data every later room reads."""
