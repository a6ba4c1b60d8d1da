"""What the compiled step keeps on the model device: one uint8 region per batch cut into arrays, and the
named outputs accumulated between host reads (docs/design.md "The path of one batch", "The TensorFlow hand-off")."""

from melfeed.consumer.train.device.accumulators import Accumulators, IntervalRead
from melfeed.consumer.train.device.packed import PackedSteps, RegionLayout

__all__ = ["Accumulators", "IntervalRead", "PackedSteps", "RegionLayout"]
