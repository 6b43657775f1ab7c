"""cpu patches."""
