"""The attention kernels' test cases, shared by every backend's tests: head and block shapes, and
batches of (cached context, new tokens) per sequence."""

import pytest

# (queries per kv head, head_dim, block_size); two kv heads each. head_dim 24 exercises a padded tile.
SHAPES = [
    pytest.param(1, 16, 4, id="gqa1-d16-bs4"),
    pytest.param(3, 24, 8, id="gqa3-d24-bs8"),
]
# (cached context, new tokens) per sequence.
BATCHES = [
    pytest.param(
        [(0, 7), (9, 5), (12, 1), (5, 1), (0, 1), (3, 2)],
        id="mixed",  # fresh prefill, chunks on context, decodes (one opening a new block), a 1-token prompt
    ),
    pytest.param([(6, 1), (28, 1), (17, 1), (1, 1), (30, 1), (25, 1)], id="decodes"),  # some padded together
    pytest.param([(21, 19), (0, 18)], id="long-chunks"),  # several query tiles per sequence under GQA
]
