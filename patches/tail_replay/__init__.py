"""tail_replay patches."""
