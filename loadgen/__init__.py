"""Load generator, in four rooms along the data flow.

- ``loadgen.run``: what is sent and how: tier cells (``cells``), prompt datasets
  (``datasets``), sweeps (``sweep``), Locust users and the HTTP client (``users``,
  ``client``, ``timing``), the Locust runner, in-process or Ray-distributed workers
  (``locust_runner``, ``ray_workers``, ``locustfile``), and the local service
  (``service``).
- ``loadgen.results``: the Parquet result writer (``writer``), the live per-cell
  summary (``summary``) and progress lines (``progress``).
- ``loadgen.cli``: ``python -m loadgen``: flags (``args``) -> auth, strategies and routes
  (``target``) -> the run's phases (``main``), the consistency check (``consistency``).
- ``loadgen.tools``: a fake OpenAI server for tests (``fake_server``), the soak, and
  the load generator's own benchmarks (``bench_scale``, ``bench_timing``).

Entry points: ``python -m loadgen`` (loadgen/cli/main.py) and
``locust -f loadgen/run/locustfile.py``. Importing this package imports neither
locust nor gevent; only ``loadgen.run.users``, ``loadgen.run.locust_runner``,
``loadgen.run.client`` and ``loadgen.run.locustfile`` do.
"""
