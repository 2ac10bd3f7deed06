"""Where bytes go: storage backends with an atomic commit."""
