"""Parallel block drafters (DFlash, DFlash 2, DSpark): model code shared by the
proposers in ``actors.proposers`` and the trainer ``train.drafters``."""
