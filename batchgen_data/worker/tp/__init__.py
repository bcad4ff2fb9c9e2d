"""Ranks over torch.distributed: starting the other ranks' processes, joining their groups and
the handshakes of setup (`launch.py`); the plain-data form of a step that rank 0 broadcasts
(`step_io.py`). docs/parallel.md."""
