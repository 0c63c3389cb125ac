"""Suite-wide setup.

Many tests fork worker processes from the pytest process. A torch op that runs in parallel in
the pytest process starts torch's OpenMP thread pool there, and a process forked afterwards
hangs in its first parallel op (the pool's threads are not copied). One intra-op thread in the
pytest process keeps any test from planting that trap for the tests after it; forked workers
set their own thread counts.
"""

import torch

torch.set_num_threads(1)
