"""Executing one rank's work: its forward / backward / update passes (run), a stage's schedule
(executor), gradient buckets, the global batch layout, feed checks, packing and traces."""
