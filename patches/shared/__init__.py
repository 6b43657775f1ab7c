"""shared patches."""
