"""sae patches."""
