"""Campaigns: commands that start the service and drive load, then judge what they measured.

They sit on top of the layers they drive (``tests/test_layers.py``): the service is started
through the bring-up layer (``cluster.launch``), the load through the load generator's own
command (``python -m loadgen``, ``drive.run_loadgen``), and every figure comes from the
analysis rooms below (``analysis.decide.validate``, ``analysis.decide.policy_validate``).

- ``plan_validation``: ``python -m analysis plan ... --validate`` (N and N - 1 replicas).
- ``policy_validation``: ``python -m analysis policy RUN --validate`` (the policy against
  each tier's best fixed strategy).
"""
