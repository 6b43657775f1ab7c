"""linearkv patches."""
