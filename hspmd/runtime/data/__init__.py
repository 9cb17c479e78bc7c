"""Training data: token files on disk, preparing them from text, and the loader that reads each rank's rows."""
