"""melfeed: fixed-shape TTS batches from out-of-process producers, for your own training loop or melfeed's.

```python
import melfeed
cfg = melfeed.config_from_mapping({"cache_dir": str(melfeed.demo_cache(300))})
with melfeed.Consumer(cfg, producers=2) as feed:   # starts the producers, stops them on leaving
    for batch in feed.batches():                    # plan order; arrays are views into a ring slot
        my_step(batch.arrays)
```
The public API is exactly the names in ``__all__`` (docs/guide/your-model.md, "A loop of your own"); every other module
(``melfeed.consumer``, ``melfeed.producer``, ``melfeed.shared``, ``melfeed.cli``) is internal and may change.
Invariant: importing ``melfeed`` imports no TensorFlow, and nothing beyond this module until a name is used (the
``melfeed`` command starts without the library's imports).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from melfeed.consumer.feed import Batch, Consumer
    from melfeed.consumer.feed_board import FeedBoard
    from melfeed.consumer.fit_resume import FitResume
    from melfeed.consumer.staging import Stager
    from melfeed.shared.config.loader import config_from_mapping, load_config
    from melfeed.shared.errors import CacheError, ClosedError, ConfigError, DataError, PipelineError, StepError

__version__ = "0.1.0"  # the package's version: pyproject.toml reads it from here

__all__ = [
    "Consumer",
    "Batch",
    "Stager",
    "FitResume",
    "FeedBoard",
    "load_config",
    "config_from_mapping",
    "demo_cache",
    "PipelineError",
    "ConfigError",
    "CacheError",
    "ClosedError",
    "DataError",
    "StepError",
    "__version__",
]

_HOMES = {  # public name -> the module that defines it (imported on first use)
    "Consumer": "melfeed.consumer.feed",
    "Batch": "melfeed.consumer.feed",
    "Stager": "melfeed.consumer.staging",
    "FitResume": "melfeed.consumer.fit_resume",
    "FeedBoard": "melfeed.consumer.feed_board",
    "load_config": "melfeed.shared.config.loader",
    "config_from_mapping": "melfeed.shared.config.loader",
    **{
        name: "melfeed.shared.errors"
        for name in ("PipelineError", "ConfigError", "CacheError", "ClosedError", "DataError", "StepError")
    },
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'melfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next access is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def demo_cache(utterances: int = 2000, *, cache_dir: str | Path | None = None) -> Path:
    """The demo cache's directory, written on first use (``melfeed demo-data``'s data, extras included).

    Args:
        utterances: 1..1000000 LJSpeech-shaped utterances (2000: about 20 s and 713 MB on first use).
        cache_dir: where to keep it; None = ``$XDG_CACHE_HOME/melfeed/demo/N`` (``--demo``'s cache).

    Raises:
        ConfigError: ``utterances`` out of range. CacheError: the directory cannot be written or is not a
            demo cache.
    """
    from melfeed.shared.cache.demo_data import default_demo_dir, write_demo_cache

    path = Path(cache_dir) if cache_dir is not None else default_demo_dir(utterances)
    write_demo_cache(path, n_utterances=utterances, extras=True, utterances_flag="demo_cache(utterances)")
    return path
