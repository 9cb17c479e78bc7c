"""The Trainer (one rank's training loop over any backend) and InProcessJob (every rank as a thread)."""
