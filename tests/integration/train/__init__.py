"""Training users' own models through the built-in loop and the library."""
