"""eaglewire: train, verify, export and run EAGLE-3 speculative-decoding drafts."""

__version__ = "0.1.0"
