"""Real producers and consumers over real ZeroMQ: delivery, both data paths, bad input, CURVE."""
