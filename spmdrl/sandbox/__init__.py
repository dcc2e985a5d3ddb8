"""Where user code runs: worker processes (``pool``) for reward functions and tools, and the importer of a
user's file (``userfile``)."""
