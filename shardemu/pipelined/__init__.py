"""The pipelined engine: stages on their own devices running a schedule for real
(`trainer.py`, `program.py`), with the layers of each stage (`layout.py`)."""
