"""What every process reads before it starts work: the ``NANOSERVE_*`` environment (env.py), the defaults several
processes share (defaults.py), the rule that a non-loopback listener needs a key (loopback.py) and command-line
logging (cli_logging.py). The lowest layer: it imports nothing of the project."""
