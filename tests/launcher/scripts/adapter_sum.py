"""Our all_sum, for a world started by someone else's launcher (mlx.launch)."""
import numpy as np

import adapter

print("SUM", adapter.all_sum(np.ones(10)).tolist(), flush=True)
