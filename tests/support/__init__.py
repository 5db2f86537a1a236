"""What tests share: step and config builders (builders), the HF oracle (oracle), real processes (processes),
a ``launch.py`` server in a subprocess (server). Test modules import from here, never from each other."""
