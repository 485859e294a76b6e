"""``python -m loadgen`` (see loadgen/cli/main.py).

gevent's monkey-patching must happen before anything imports ssl, sockets or
threads, so it is done here, first, and only in the load-generator process
(never on import of the loadgen package, which tests and analysis import).
"""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402

from loadgen.cli.main import main  # noqa: E402

sys.exit(main())
