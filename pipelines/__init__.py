"""Generation and decode logic per model family."""
