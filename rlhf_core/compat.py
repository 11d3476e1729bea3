"""What the installed transformers release offers, where the supported range (4.56 and later) differs."""

from __future__ import annotations

import transformers
from packaging.version import Version

_RELEASE = Version(transformers.__version__).release

CACHE = "cache" if _RELEASE >= (5, 24) else "past_key_values"
"""The KV cache's keyword and output field: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name
warns and goes in 5.40); earlier releases know only the old one."""

STATIC_CACHE = _RELEASE >= (5,)
"""Whether ``StaticCache`` keeps its own write position (5.0 and later); before, every call had to pass it."""
