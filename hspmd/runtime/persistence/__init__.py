"""Checkpoints that load under any strategy: single-file, sharded and Hugging Face formats, the
integrity checks they share, and the `hspmd checkpoint` command."""
