"""What every process reads before it starts work: the ``NANOSERVE_*`` environment (env.py) and command-line
logging (cli_logging.py). The lowest layer: it imports nothing of the project."""
