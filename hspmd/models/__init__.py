"""Models written in the hspmd DSL (and their plain-torch references)."""
