"""Load generator, in four rooms along the data flow.

- ``loadgen.run``: what is sent and how: tier cells (``cells``), prompt datasets
  (``datasets``), sweeps (``sweep``), Locust users and the HTTP client (``users``,
  ``client``, ``timing``), the Locust runner, in-process or Ray-distributed workers
  (``locust_runner``, ``ray_workers``, ``locustfile``), and the target outside the
  load (``service``: models, routes, step log; the local service starts through
  ``cluster.launch``).
- ``loadgen.results``: the Parquet result writer (``writer``), the live per-cell
  summary (``summary``) and progress lines (``progress``).
- ``loadgen.cli``: ``python -m loadgen``: flags (``args``) -> auth, strategies and routes
  (``target``) -> the run's phases (``main``), the consistency check (``consistency``).
- ``loadgen.tools``: a fake OpenAI server for tests (``fake_server``) and the soak
  (its benchmarks live in ``bench``: ``bench.loadgen_scale``, ``bench.loadgen_timing``).

Entry points: ``python -m loadgen`` (loadgen/cli/main.py) and
``locust -f loadgen/run/locustfile.py``. Importing this package imports neither
locust nor gevent; only ``loadgen.run.users``, ``loadgen.run.locust_runner``,
``loadgen.run.client`` and ``loadgen.run.locustfile`` do.
"""
