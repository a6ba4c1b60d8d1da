"""FeedBoard's pure part: a planned batch's rows and frames, from the plan and the manifest's lengths."""

from __future__ import annotations

import numpy as np

from melfeed.consumer.feed_board import planned_frames
from melfeed.shared.wire.buckets import Bucket


def test_a_planned_batch_counts_each_utterance_up_to_its_bucket_over_the_bucket_shape() -> None:
    bucket = Bucket(index=1, batch_size=4, max_frames=100, max_tokens=20, n_mels=80)
    frames = np.array([10, 250, 60, 100, 7], dtype=np.int64)  # utterance 1 is overlong: cut to 100
    assert planned_frames((1, 2, 3), bucket, frames) == (3, 260, 400)  # 3 real rows of 4, one a padding row
    assert planned_frames((), bucket, frames) == (0, 0, 400)
