"""Load generator: Locust users, tier cells, prompt datasets, the runner and the result writer.

Entry points: ``python -m loadgen`` (loadgen/cli.py) and
``locust -f loadgen/locustfile.py``. Importing this package imports neither
locust nor gevent; only ``loadgen.users``, ``loadgen.locust_runner``, ``loadgen.client``
and ``loadgen.locustfile`` do.
"""
