"""Policies over the trainer: elastic recovery, mixed-length training with per-step strategies,
and calibration of the cost model from measured steps."""
