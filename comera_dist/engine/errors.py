"""The error type for bad user input found while setting up a run (CLI: one line, exit 2)."""


class InputError(ValueError):
    """Bad input outside the config file itself: a missing or empty corpus, a tokenizer/model
    vocabulary mismatch, a sequence length beyond the model's positions, an unreadable cache or
    checkpoint. The message names the file, key or value at fault."""
